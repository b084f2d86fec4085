"""bench.py serve (benchmarks/serve.py) against a fake OpenAI streaming server in this process:
the counts it reports are what the fake sent, and its latencies respect the fake's sleeps.

The fake sleeps TTFT before a stream's first chunk and GAP between chunks, one token per chunk,
over chunked transfer encoding as uvicorn sends it. A sleep bounds a latency from below for sure;
the upper bounds are loose (a busy CI machine delays threads), so nothing here is a tight timing.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from benchmarks import serve

TTFT, GAP = 0.05, 0.03


class FakeServer:
    """Streams max_tokens chunks of text "x". A prompt of at least `long_at` tokens holds a lock
    for `stall` seconds before its first token, and every stream takes that lock before each
    chunk: a whole-prompt prefill that stalls the running streams."""

    def __init__(self, ttft: float = TTFT, gap: float = GAP, stall: float = 0.0, long_at: int = 10**9):
        self.ttft, self.gap, self.stall, self.long_at = ttft, gap, stall, long_at
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        self.prefill = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def reply(self, status: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def event(self, data: bytes) -> None:  # one HTTP chunk per server-sent event
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

            def do_GET(self):
                self.reply(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append(body)
                fake.auth.append(self.headers.get("Authorization"))
                if body["model"] != "fake-model":
                    return self.reply(404, {"error": {"message": f"no model {body['model']}", "type": "not_found"}})
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                n = body["max_tokens"]
                if len(body["prompt"]) >= fake.long_at:
                    with fake.prefill:
                        time.sleep(fake.stall)
                else:
                    time.sleep(fake.ttft)
                for i in range(n):
                    if i:
                        time.sleep(fake.gap)
                    with fake.prefill:  # waits out a long prefill
                        pass
                    choice = {"index": 0, "text": "x", "finish_reason": "length" if i == n - 1 else None}
                    self.event(b"data: " + json.dumps({"id": "c", "object": "text_completion", "choices": [choice]}).encode() + b"\n\n")
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n, "total_tokens": len(body["prompt"]) + n}
                self.event(b"data: " + json.dumps({"id": "c", "object": "text_completion", "choices": [], "usage": usage}).encode() + b"\n\n")
                self.event(b"data: [DONE]\n\n")
                self.event(b"")  # the last chunk of chunked encoding

        return Handler

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake():
    servers = []

    def start(**kw) -> FakeServer:
        servers.append(FakeServer(**kw))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def test_counts_and_latencies_match_the_fake_server(fake):
    server = fake()
    row, results = serve.run(server.url, requests=8, clients=4, prompt_len=(3, 6), output_len=(5, 5), seed=1,
                             api_key="k", label="fake", progress=False)
    assert (row["completed"], row["failed"], row["first_error"]) == (8, 0, None)
    assert row["model"] == "fake-model" and row["label"] == "fake"
    assert row["completion_tokens"] == 40 and all(len(r.chunks) == 5 for r in results)
    assert row["output_tok_s"] == pytest.approx(40 / row["wall_s"])
    assert row["requests_s"] == pytest.approx(8 / row["wall_s"])
    # the request the fake saw
    assert len(server.bodies) == 8 and set(server.auth) == {"Bearer k"}
    for body in server.bodies:
        assert body["stream"] and body["ignore_eos"] and body["stream_options"] == {"include_usage": True}
        assert body["temperature"] == 0 and body["max_tokens"] == 5
        assert 3 <= len(body["prompt"]) <= 6 and all(1000 <= t < 30000 for t in body["prompt"])
    # each request lasts at least TTFT + 4 GAP, and each client sends two one after the other
    one = TTFT + 4 * GAP
    assert all(r.chunks[-1] - r.sent >= one for r in results)
    assert 2 * one <= row["wall_s"] < 2 * one + 10
    assert TTFT * 1e3 <= row["ttft_p50_ms"] <= row["ttft_p99_ms"] < TTFT * 1e3 + 2000
    assert 0.3 * GAP * 1e3 <= row["itl_p50_ms"] <= row["itl_p99_ms"] < GAP * 1e3 + 2000
    assert "long_ttft_ms" not in row


def test_the_seed_fixes_the_workload(fake):
    server = fake(ttft=0, gap=0)
    for _ in range(2):
        serve.run(server.url, requests=5, clients=2, prompt_len=(1, 50), output_len=(1, 9), seed=3, progress=False)
    first, second = server.bodies[:5], server.bodies[5:]
    key = lambda b: (b["prompt"], b["max_tokens"])  # noqa: E731
    assert sorted(map(key, first)) == sorted(map(key, second))
    assert len({len(b["prompt"]) for b in first}) > 1


def test_failed_requests_are_counted_with_the_first_error(fake):
    server = fake(ttft=0, gap=0)
    row, _ = serve.run(server.url, requests=3, clients=2, prompt_len=(2, 2), output_len=(2, 2), model="other",
                       progress=False)
    assert (row["completed"], row["failed"], row["completion_tokens"]) == (0, 3, 0)
    assert row["first_error"] == "HTTP 404: no model other"
    assert row["ttft_p50_ms"] is None and row["output_tok_s"] == 0


def test_a_long_prefill_shows_in_the_gaps_that_overlap_it(fake):
    """The long prompt arrives while 4 streams run; its prefill holds them for `stall`: the gaps
    that overlap its wait for a first token include that stall, the rest stay near GAP."""
    stall, gap = 0.4, 0.02
    server = fake(gap=gap, stall=stall, long_at=100)
    row, results = serve.run(server.url, requests=4, clients=4, prompt_len=(4, 4), output_len=(30, 30),
                             long_prompt=200, long_after=0.15, progress=False)
    assert row["completed"] == 4 and row["long_error"] is None and row["long_prompt"] == 200
    assert len(server.bodies[-1]["prompt"]) == 200 and server.bodies[-1]["max_tokens"] == 16
    assert row["long_ttft_ms"] >= stall * 1e3
    assert row["gaps_during_long"] >= 1
    assert row["itl_during_long_max_ms"] >= 0.5 * stall * 1e3
    assert row["itl_p50_ms"] < 0.5 * stall * 1e3  # one stalled gap in 29 per stream


def test_unreachable_server_is_a_one_line_error():
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(ValueError, match=rf"^cannot reach {url}: "):
        serve.run(url, requests=1, clients=1, prompt_len=(1, 1), output_len=(1, 1), progress=False)

    import bench

    with pytest.raises(SystemExit) as e:
        bench.main(["serve", "--url", url, "--requests", "1"])
    message = str(e.value.code)
    assert message.startswith(f"error: cannot reach {url}: ") and "\n" not in message


def test_the_command_line_prints_a_table_and_writes_json_and_a_plot(fake, tmp_path, capsys):
    import bench

    server = fake(ttft=0.01, gap=0.005)
    out = tmp_path / "serve.jsonl"
    bench.main(["serve", "--url", server.url + "/", "--requests", "4", "--clients", "2", "--prompt-len", "8",
                "--output-len", "3:4", "--label", "fp16", "--json", str(out), "--plot", str(tmp_path / "serve.png")])
    table = capsys.readouterr().out
    assert "| label | clients | completed |" in table and "| fp16 | 2 | 4 |" in table
    row = json.loads(out.read_text())
    assert row["bench"] == "serve" and row["label"] == "fp16" and row["failed"] == 0
    assert 12 <= row["completion_tokens"] <= 16 and all(len(b["prompt"]) == 8 for b in server.bodies)
    assert (tmp_path / "serve.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="--output-len takes LO:HI"):
        bench.main(["serve", "--url", server.url, "--output-len", "5:2"])
