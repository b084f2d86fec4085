"""`engine.py serve` as a real server process on a free localhost port, driven by the official
`openai` client (and raw HTTP for what that client cannot send).

Oracles: LLM.generate in this process on the same model and settings (greedy text and token
counts), the model's own tokenizer.json read by HF tokenizers (prompt token counts), and the
OpenAI error schema. A tiny llama with kitty pages (sink 4, window 8), so answers pass through
quantized pages.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import tokenizers

openai = pytest.importorskip("openai")

from llm import LLM  # noqa: E402
from sampling import SamplingParams  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = dict(kv="kitty", sink=4, window=8, max_batch=8, kv_budget_gb=0.05)
MODEL = "tiny"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("served")
    make_tiny_model("llama", folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return folder


class Server:
    """A server process on a free port; its log is kept for the tests to read."""

    def __init__(self, model_dir: Path, log: Path, *extra: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        args = [f"--{k.replace('_', '-')}={v}" for k, v in SETTINGS.items()]
        self.proc = subprocess.Popen(
            [sys.executable, "engine.py", "serve", "--model", str(model_dir), "--device", "cpu", "--port", str(self.port),
             "--served-model-name", MODEL, *args, *extra],
            cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited:\n{log.read_text()}")
            try:
                if http("GET", self.url + "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"the server did not start:\n{log.read_text()}")

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60)

    def metrics(self) -> dict[str, float]:
        text = http("GET", self.url + "/metrics")[1]
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("nanokv_")}

    def pool_is_full(self, timeout: float = 15) -> bool:
        """Every page and slot free, and nothing running or waiting (waits for the engine to get there)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = self.metrics()
            if (m['nanokv_kv_pages_used{tier="pages"}'] == 0 and m['nanokv_kv_pages_used{tier="sink"}'] == 0
                    and m["nanokv_requests_running"] == 0 and m["nanokv_requests_waiting"] == 0):
                return True
            time.sleep(0.1)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def http(method: str, url: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, str, dict]:
    """Status, text and headers (lower-case names) of a raw request, errors included."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode(), {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), {k.lower(): v for k, v in e.headers.items()}


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = Server(model_dir, tmp_path_factory.mktemp("log") / "server.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oracle(model_dir) -> LLM:
    return LLM(str(model_dir), device="cpu", progress=False, **SETTINGS)


def alone(oracle: LLM, prompt: str | list[int], max_tokens: int) -> tuple[str, int]:
    """Greedy text and token count of a request run alone in this process."""
    [req] = oracle.generate([prompt], SamplingParams(max_new_tokens=max_tokens))
    return req.text, len(req.output_ids)


def test_completions_streamed_and_not_equal_llm_generate(server, oracle, model_dir):
    client = server.client()
    prompt = "The quick brown fox jumps over the lazy dog. " * 3  # past sink + window: kitty pages
    text, n = alone(oracle, prompt, 20)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    assert r.choices[0].text == text and r.choices[0].finish_reason == "length" and r.object == "text_completion"
    hf_count = len(tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(prompt).ids)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (hf_count, n, hf_count + n) == (hf_count, 20, hf_count + 20)

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20

    ids = list(range(40, 100))  # a prompt of token ids
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=7, temperature=0)
    assert (r.choices[0].text, r.usage.completion_tokens) == alone(oracle, ids, 7)
    assert r.usage.prompt_tokens == len(ids)


def test_chat_streamed_and_not_equal_llm_generate(server, oracle):
    client = server.client()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Tell me about foxes and dogs."}]
    prompt = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages) + "<|assistant|>"  # CHAT_TEMPLATE by hand
    ids = oracle.tokenizer.encode(prompt, add_bos=False)
    text, n = alone(oracle, ids, 16)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.object == "chat.completion" and r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == n
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == n


def test_seeded_sampling_repeats(server):
    client = server.client()
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, top_p=0.9, seed=7, extra_body={"top_k": 50})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


BAD_BODIES = [
    ("malformed JSON", "completions", b'{"model": "tiny", "prompt": '),
    ("not an object", "completions", [1, 2]),
    ("missing model", "completions", {"prompt": "hi"}),
    ("missing prompt", "completions", {"model": MODEL}),
    ("prompt of the wrong type", "completions", {"model": MODEL, "prompt": 12}),
    ("token id outside the vocabulary", "completions", {"model": MODEL, "prompt": [1, 2, 999]}),
    ("two prompts", "completions", {"model": MODEL, "prompt": ["a", "b"]}),
    ("missing messages", "chat/completions", {"model": MODEL}),
    ("messages of the wrong type", "chat/completions", {"model": MODEL, "messages": "hi"}),
    ("a message without a role", "chat/completions", {"model": MODEL, "messages": [{"content": "hi"}]}),
    ("max_tokens 0", "completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}),
    ("max_tokens negative", "completions", {"model": MODEL, "prompt": "hi", "max_tokens": -3}),
    ("max_tokens a string", "completions", {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}),
    ("max_tokens true", "completions", {"model": MODEL, "prompt": "hi", "max_tokens": True}),
    ("max_tokens beyond the context", "completions", {"model": MODEL, "prompt": "hi", "max_tokens": 600}),
    ("prompt longer than the context", "completions", {"model": MODEL, "prompt": "x" * 600}),
    ("negative temperature", "completions", {"model": MODEL, "prompt": "hi", "temperature": -1}),
    ("top_p 0", "completions", {"model": MODEL, "prompt": "hi", "top_p": 0}),
    ("top_p above 1", "completions", {"model": MODEL, "prompt": "hi", "top_p": 1.5}),
    ("n 2", "completions", {"model": MODEL, "prompt": "hi", "n": 2}),
    ("n 2 in chat", "chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}),
    ("unknown model", "completions", {"model": "gpt-9", "prompt": "hi"}),
    ("an empty stop string", "completions", {"model": MODEL, "prompt": "hi", "stop": [""]}),
    ("stream not a boolean", "completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}),
]


@pytest.mark.parametrize("case, route, body", BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
def test_bad_input_gets_400_and_the_server_keeps_serving(server, case, route, body):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, text, _ = http("POST", f"{server.url}/v1/{route}", raw, {"Content-Type": "application/json"})
    assert status == 400, (case, status, text)
    error = json.loads(text)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["message"]
    r = server.client().completions.create(model=MODEL, prompt="still there?", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_the_official_client_sees_a_bad_request_error(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert e.value.status_code == 400 and "max_tokens" in str(e.value)


def test_a_body_over_the_limit_gets_413(server):
    """The server answers 413 as soon as the body passes the limit and closes the connection, so
    a client still sending may see a broken pipe first: the answer is read after the send either way."""
    import http.client
    from urllib.parse import urlsplit

    body = json.dumps({"model": MODEL, "prompt": "x" * (2 * 2**20)}).encode()
    conn = http.client.HTTPConnection(urlsplit(server.url).netloc, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert conn.getresponse().status == 413
    conn.close()


def test_a_cancelled_stream_frees_its_pages(server):
    stream = server.client().completions.create(model=MODEL, prompt="A long story: " * 8, max_tokens=400,
                                                temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert server.metrics()['nanokv_kv_pages_used{tier="pages"}'] > 0  # still running: it holds pages
    stream.close()
    assert server.pool_is_full()
    assert server.metrics()['nanokv_requests_finished_total{reason="cancelled"}'] >= 1


def test_load_with_cancellations(server, oracle):
    """64 concurrent clients, random lengths, about 10% cancelled mid-stream: every other request
    completes with the text it gets alone, nothing is logged as an error, and the pool ends full."""
    rng = random.Random(0)
    words = "the fox dog runs jumps over lazy brown quick and a of to".split()
    jobs = [(" ".join(rng.choices(words, k=rng.randint(1, 40))), rng.randint(1, 40), rng.random() < 0.1)
            for _ in range(64)]
    results: dict[int, tuple] = {}
    client = server.client()

    def run(i: int) -> None:
        prompt, max_tokens, cancel = jobs[i]
        try:
            stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                               stream=True, stream_options={"include_usage": True})
            text, usage = [], None
            for j, chunk in enumerate(stream):
                if cancel and j == max_tokens // 2:
                    stream.close()
                    break
                text.append(chunk.choices[0].text if chunk.choices else "")
                usage = chunk.usage or usage
            results[i] = ("".join(text), usage.completion_tokens if usage else None)
        except Exception as e:  # reported below, with the request
            results[i] = ("error", repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    completed = 0
    for i, (prompt, max_tokens, cancel) in enumerate(jobs):
        assert results[i][0] != "error", results[i]
        if not cancel:
            assert results[i] == alone(oracle, prompt, max_tokens), (i, prompt, max_tokens)
            completed += 1
    assert completed >= 50
    assert server.pool_is_full()
    log = server.log.read_text()
    assert "ERROR" not in log and "Traceback" not in log, log[-3000:]


def test_bench_serve_counts_what_the_server_streams(server):
    """bench.py serve's client against the real server: every request completes with exactly the
    output length it drew (EOS ignored), and its timings are ordered and positive."""
    from benchmarks import serve

    row, results = serve.run(server.url, requests=12, clients=4, prompt_len=(5, 30), output_len=(3, 9), seed=3, vocab=256,
                    progress=False, long_prompt=200, long_after=0.2)
    rng = random.Random(3)  # the draws run() makes: prompt ids first, then the output length
    expected = 0
    for _ in range(12):
        [rng.choice(range(128, 256)) for _ in range(rng.randint(5, 30))]
        expected += rng.randint(3, 9)
    assert (row["completed"], row["failed"]) == (12, 0) and row["long_error"] is None
    assert sum(r.completion_tokens for r in results) == expected
    assert all(1 <= len(r.chunks) <= r.completion_tokens for r in results)  # half characters wait for the rest
    assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] and 0 < row["itl_p50_ms"] <= row["itl_p99_ms"] <= row["itl_max_ms"]
    assert row["output_tok_s"] == pytest.approx(expected / row["wall_s"])


@pytest.fixture(scope="module")
def strict_server(model_dir, tmp_path_factory):
    """One slot, one waiting place, and an API key."""
    s = Server(model_dir, tmp_path_factory.mktemp("log") / "strict.log", "--api-key", "sesame", "--max-batch", "1",
               "--max-waiting", "1")
    yield s
    s.stop()


def test_auth_is_required_but_for_health(strict_server):
    with pytest.raises(openai.AuthenticationError):
        strict_server.client("wrong").models.list()
    assert http("GET", strict_server.url + "/v1/models")[0] == 401
    assert http("GET", strict_server.url + "/metrics")[0] == 401
    assert http("GET", strict_server.url + "/health")[0] == 200
    assert [m.id for m in strict_server.client("sesame").models.list()] == [MODEL]


def test_a_full_queue_gets_429_with_retry_after(strict_server):
    client = strict_server.client("sesame")
    running = client.completions.create(model=MODEL, prompt="one", max_tokens=300, temperature=0, stream=True)
    next(iter(running))  # it holds the only slot
    waiting = client.completions.create(model=MODEL, prompt="two", max_tokens=300, temperature=0, stream=True)
    deadline = time.time() + 10
    while http("GET", strict_server.url + "/metrics", headers={"Authorization": "Bearer sesame"})[1].count(
            "nanokv_requests_waiting 1.0") == 0 and time.time() < deadline:
        time.sleep(0.05)
    status, text, headers = http("POST", strict_server.url + "/v1/completions",
                                 json.dumps({"model": MODEL, "prompt": "three"}).encode(),
                                 {"Authorization": "Bearer sesame"})
    assert status == 429 and headers.get("retry-after") and json.loads(text)["error"]["code"] == "rate_limit_exceeded"
    running.close()
    waiting.close()


def test_sigterm_drains_then_exits(model_dir, tmp_path):
    s = Server(model_dir, tmp_path / "drain.log")
    try:
        stream = iter(s.client().completions.create(model=MODEL, prompt="drain me", max_tokens=60, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
        chunks = [next(stream)]
        s.proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 10
        while http("GET", s.url + "/health")[0] != 503 and time.time() < deadline:
            time.sleep(0.05)
        status, text, _ = http("POST", s.url + "/v1/completions", json.dumps({"model": MODEL, "prompt": "late"}).encode())
        assert status == 503 and json.loads(text)["error"]["code"] == "unavailable"
        chunks += list(stream)  # the running request finishes in full
        assert chunks[-1].usage.completion_tokens == 60
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert s.proc.wait(30) == 0
        assert "ERROR" not in s.log.read_text()
    finally:
        s.stop()
