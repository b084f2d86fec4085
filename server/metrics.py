"""The server's Prometheus metrics: requests running and waiting, the KV cache's use per tier,
tokens, and step time, in a registry of its own (so that two servers in one process do not
collide). Gauges are read from the engine when /metrics is scraped; counters and the step-time
histogram are fed by the engine thread."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from llm import LLM, Request

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    def __init__(self, llm: LLM):
        self.registry = registry = CollectorRegistry()
        cache = llm.cache
        Gauge("nanokv_requests_running", "requests holding a cache slot (prefilling or decoding)",
              registry=registry).set_function(lambda: len(llm.running) + len(llm.prefilling))
        Gauge("nanokv_requests_waiting", "requests queued for a cache slot and pages",
              registry=registry).set_function(lambda: len(llm.waiting))
        # The sink and recent tiers are dense blocks owned by a sequence's slot; the quantized
        # tier is the shared page pool.
        used = Gauge("nanokv_kv_pages_used", "KV blocks in use per tier (sink and recent: slots; pages: pool pages)",
                     ["tier"], registry=registry)
        free = Gauge("nanokv_kv_pages_free", "KV blocks free per tier (sink and recent: slots; pages: pool pages)",
                     ["tier"], registry=registry)
        for tier in ("sink", "recent"):
            used.labels(tier).set_function(lambda: cache.max_seqs - cache.num_free_slots)
            free.labels(tier).set_function(lambda: cache.num_free_slots)
        used.labels("pages").set_function(lambda: cache.pool.num_pages - cache.pool.num_free)
        free.labels("pages").set_function(lambda: cache.pool.num_free)
        self.prompt_tokens = Counter("nanokv_prompt_tokens", "prompt tokens of finished requests", registry=registry)
        self.generated_tokens = Counter("nanokv_generated_tokens", "tokens generated for finished requests",
                                        registry=registry)
        self.requests = Counter("nanokv_requests_finished", "finished requests by reason", ["reason"], registry=registry)
        self.step_seconds = Histogram("nanokv_step_seconds", "wall time of one engine step (prefill chunks + decode)",
                                      registry=registry, buckets=(.001, .0025, .005, .01, .02, .04, .08, .16, .32, .64,
                                                                  1.28, 2.56, 5.12))

    def observe_step(self, seconds: float) -> None:
        self.step_seconds.observe(seconds)

    def observe_finish(self, req: Request) -> None:
        self.prompt_tokens.inc(len(req.prompt_ids))
        self.generated_tokens.inc(len(req.output_ids))
        self.requests.labels(req.finish_reason or "error").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
