"""The client side of a serving benchmark (as vLLM's benchmark_serving): concurrent streaming
clients against a running OpenAI-compatible server, timing every streamed chunk.

Each of C clients sends its next request when its last one ends, until N requests are done.
Prompt and output lengths are drawn uniformly from ranges with a seed; prompts are random token
ids and outputs ignore EOS, so every run asks the same work of the server. TTFT is the time from
sending a request to its first streamed text; ITL the gap between consecutive streamed chunks
with text of one request.

With long_prompt, one extra request with a prompt that long (and 16 output tokens) is sent
`long_after` seconds in. The other streams' gaps that overlap its wait for its first token,
[sent, first token], measure how much its prefill stalls them (chunked prefill exists to keep
them short).

Standard library only (http.client, a thread per client): the GPU machines it runs on install
nothing.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

from tqdm import tqdm


@dataclass
class Result:
    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival time of each chunk with text
    completion_tokens: int = 0  # from the usage chunk
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.sent if self.chunks else None

    def gaps(self) -> list[tuple[float, float]]:
        """(start, end) of every inter-token gap."""
        return list(zip(self.chunks, self.chunks[1:]))


def _connect(url: str, timeout: float) -> http.client.HTTPConnection:
    parts = urllib.parse.urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return cls(parts.hostname, parts.port, timeout=timeout)


def _error_message(status: int, body: bytes) -> str:
    """'HTTP 404: message' from an OpenAI error body ({"error": {"message": ...}}), else its text."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace")[:300]
    return f"HTTP {status}: {message}"


def complete(url: str, headers: dict, model: str, prompt: list[int], max_tokens: int) -> Result:
    """One streamed completion; every failure is kept in the Result, none raised."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    result = Result(time.perf_counter())
    conn = _connect(url, timeout=600)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        response = conn.getresponse()
        if response.status != 200:
            result.error = _error_message(response.status, response.read())
            return result
        for line in response:  # server-sent events: 'data: {...}' lines, blank lines between
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            now, chunk = time.perf_counter(), json.loads(line[6:])
            if "error" in chunk:  # a failure after the 200 header went out
                err = chunk["error"]
                result.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            elif chunk.get("choices") and chunk["choices"][0].get("text"):
                result.chunks.append(now)
            if chunk.get("usage"):
                result.completion_tokens = chunk["usage"]["completion_tokens"]
    except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
        result.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return result


def served_model(url: str, headers: dict) -> str:
    """The first model id of GET /v1/models; a server that cannot be reached is a ValueError."""
    conn = _connect(url, timeout=10)
    try:
        conn.request("GET", "/v1/models", headers=headers)
        response = conn.getresponse()
        body = response.read()
    except (OSError, http.client.HTTPException) as e:
        raise ValueError(f"cannot reach {url}: {e}") from None
    finally:
        conn.close()
    if response.status != 200:
        raise ValueError(f"GET {url}/v1/models: {_error_message(response.status, body)}")
    return json.loads(body)["data"][0]["id"]


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank q-th percentile; None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def run(url: str, *, requests: int, clients: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
        seed: int = 0, vocab: int = 32000, model: str | None = None, api_key: str | None = None,
        long_prompt: int = 0, long_after: float = 2.0, label: str | None = None,
        progress: bool = True) -> tuple[dict, list[Result]]:
    """Run the workload; returns the summary row and every request's Result (in request order)."""
    if requests < 1 or clients < 1:
        raise ValueError(f"--requests and --clients must be at least 1, not {requests} and {clients}")
    url = url.rstrip("/")
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    served = served_model(url, headers)  # also checks that the server is there before any thread starts
    model = model or served
    rng = random.Random(seed)
    ids = range(min(1000, vocab // 2), min(vocab, 30000))  # past the special tokens of most vocabularies
    jobs = [([rng.choice(ids) for _ in range(rng.randint(*prompt_len))], rng.randint(*output_len))
            for _ in range(requests)]
    long_job = [rng.choice(ids) for _ in range(long_prompt)]
    results: list[Result] = [Result(0.0, error="not sent")] * requests
    todo = iter(range(requests))
    lock = threading.Lock()
    bar = tqdm(total=requests, desc="requests", unit="req", disable=not progress)
    long_result: list[Result] = []

    def client() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            results[i] = complete(url, headers, model, *jobs[i])
            bar.update(1)

    def long_request() -> None:
        time.sleep(long_after)
        long_result.append(complete(url, headers, model, long_job, 16))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    if long_prompt:
        threads.append(threading.Thread(target=long_request, daemon=True))
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    bar.close()

    done = [r for r in results if not r.error]
    failed = [r for r in results if r.error]
    ttft = [r.ttft for r in done if r.ttft is not None]
    itl = [b - a for r in done for a, b in r.gaps()]
    tokens = sum(r.completion_tokens for r in done)
    row = dict(bench="serve", label=label, url=url, model=model, requests=requests, clients=clients,
               completed=len(done), failed=len(failed), first_error=failed[0].error if failed else None,
               completion_tokens=tokens, wall_s=wall, output_tok_s=tokens / wall, requests_s=len(done) / wall,
               ttft_p50_ms=_ms(percentile(ttft, 50)), ttft_p99_ms=_ms(percentile(ttft, 99)),
               itl_p50_ms=_ms(percentile(itl, 50)), itl_p99_ms=_ms(percentile(itl, 99)),
               itl_max_ms=_ms(max(itl, default=None)))
    if long_result:
        lr = long_result[0]
        end = lr.chunks[0] if lr.chunks else lr.sent
        # the other streams' gaps that overlap [long request sent, its first token]
        during = [b - a for r in done for a, b in r.gaps() if a < end and b > lr.sent]
        row.update(long_prompt=long_prompt, long_ttft_ms=_ms(lr.ttft), long_error=lr.error,
                   gaps_during_long=len(during), itl_during_long_p50_ms=_ms(percentile(during, 50)),
                   itl_during_long_p99_ms=_ms(percentile(during, 99)), itl_during_long_max_ms=_ms(max(during, default=None)))
    return row, results


def plot(results: list[Result], path: str, title: str) -> None:
    """Cumulative distributions of TTFT and ITL of the completed requests, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if not r.error]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, name, values in [(axes[0], "TTFT (ms)", [r.ttft * 1e3 for r in done if r.ttft is not None]),
                             (axes[1], "ITL (ms)", [(b - a) * 1e3 for r in done for a, b in r.gaps()])]:
        values = sorted(v for v in values if v > 0)  # a log axis: two chunks read at once would be a zero gap
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))])
        ax.set(xlabel=name, ylabel="cumulative fraction", xscale="log" if values else "linear")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
