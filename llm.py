"""The engine's library: LLM takes requests, schedules them with continuous batching, and
streams their text.

A request waits in a queue until the cache can admit it (a free slot and pages for its longest
possible length). Its prompt is then prefilled alone, in chunks of at most `prefill_chunk`
tokens per step (chunked prefill): a long prompt is spread over several steps, each also running
the decode step of the batch, so running streams keep their pace while it arrives. After its last
chunk the request joins the running batch: every step feeds each running sequence its last
token, samples the next one on the device (runner.py), and retires the sequences that hit EOS, a
stop string or their token limit. Their pages return to the pool, and waiting requests take
their place between steps.

The host never waits for the step it has just launched: a step's tokens are read one step
later, while the GPU runs the following step. So EOS and stop strings are seen one step late: a
finished sequence may compute one extra token, which is dropped. Token limits are counted on
the host and are never overrun.

    from llm import LLM, SamplingParams
    llm = LLM(kv="kitty")                        # the default model; settings: config.EngineConfig
    [req] = llm.generate(["The capital of France is"], SamplingParams(max_new_tokens=20))
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

import loading
import tp as tp_group
from config import EngineConfig, kv_format
from kvcache import KVCache
from model import Transformer
from runner import Launched, ModelRunner
from sampling import SamplingParams
from tokenizer import Tokenizer


@dataclass
class Request:
    id: int
    prompt_ids: list[int]
    params: SamplingParams
    on_text: Callable[[Request, str], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "eos" | "stop" | "length" | "cancelled"
    slot: int | None = None
    n_prefilled: int = 0  # prompt tokens already in the cache
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

    def __init__(self, model: str | Transformer | None = None, tokenizer: Tokenizer | None = None, **settings):
        """model: an HF folder, hub repo id or .gguf file to load (None: the default model), or a
        Transformer already built (then `tokenizer` goes with it; without one, prompts and
        outputs are token ids only, as in the benchmarks). settings: the fields of
        config.EngineConfig (kv, sink, window, kv_budget_gb, max_batch, device, ...)."""
        self.config = config = EngineConfig(**settings)
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:  # the user's setting wins
            torch.set_num_threads(available_cpus())
        dtype = getattr(torch, config.dtype) if isinstance(config.dtype, str) else config.dtype
        # tensor parallel: this rank's slice of the model and of the KV heads; rank 0 schedules
        self.tp = tp_group.init(config.tp, self.device) if config.tp > 1 else None
        if self.tp:
            self.device = self.tp.device
        if not isinstance(model, Transformer):
            model, tokenizer = loading.load_model(model, device=self.device, dtype=dtype, allow_pickle=config.allow_pickle,
                                                  progress=config.progress and self.is_leader, tp=self.tp)
        elif getattr(model, "tp", None) is not self.tp:
            raise ValueError(f"tp={config.tp}, but the model given is split for "
                             f"{getattr(getattr(model, 'tp', None), 'size', 1)} rank(s): build it with "
                             f"tp=tp.init({config.tp}, device) (shapes.random_model, loading.load_weights)")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.eos_ids = tokenizer.eos_ids if tokenizer else set()
        mc = model.config
        fmt = kv_format(config.kv, config.kv_plan)
        budget = None
        if config.num_pages is None:
            budget = int(config.kv_budget_gb * 2**30) if config.kv_budget_gb else default_kv_budget(self.device)
            if self.tp:  # every rank must hold the same pages: the GPU with the least free memory decides
                budget = self.tp.smallest(budget)
        self.cache = KVCache(
            fmt, n_layers=mc.n_layers, n_kv_heads=mc.n_kv_heads // config.tp, head_dim=mc.head_dim, sink=config.sink,
            window=config.window, max_seqs=config.max_batch, max_seq_len=mc.max_seq_len, budget_bytes=budget,
            num_pages=config.num_pages, device=self.device, dtype=next(model.parameters()).dtype,
            sliding_window=mc.sliding_window, backend=None if config.backend == "auto" else config.backend,
        )
        graphs = config.cuda_graphs and self.device.type == "cuda" and config.backend != "torch"
        self.cache.warm_up()
        self.runner = ModelRunner(model, self.cache, config.max_batch, graphs, self.tp)
        self.waiting: collections.deque[Request] = collections.deque()
        self.prefilling: collections.deque[Request] = collections.deque()  # admitted, prompt partly in the cache
        self.running: list[Request] = []
        self._ids = itertools.count()
        self._in_flight: collections.deque[Launched] = collections.deque()  # sampled, not yet read
        self._finished_lengths: list[int] = []  # stored tokens of each sequence of this run, at its end
        self._told: list[dict] = []  # rank 0: what the followers must do before the next step (tp > 1)
        self._closed = False
        self.reset_timing()

    @property
    def is_leader(self) -> bool:
        """This process schedules, prints and serves: always, except on ranks 1.. of a tensor-parallel group."""
        return self.tp is None or self.tp.leader

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    on_text: Callable[[Request, str], None] | None = None) -> Request:
        """Queue a prompt (text or token ids). Raises ValueError for a prompt that can never run."""
        req = self.new_request(prompt, params, on_text)
        self.enqueue(req)
        return req

    def new_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    on_text: Callable[[Request, str], None] | None = None) -> Request:
        """A checked request, not yet queued (ValueError for a prompt that can never run). It
        reads the engine's state but changes none, so a server's threads may call it while
        another thread steps the engine; that thread then enqueues the request."""
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty: give at least one token of text")
        ctx = self.model.config.max_seq_len
        if len(ids) >= ctx:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the model's context is {ctx}: shorten the prompt "
                f"to at most {ctx - 1} tokens"
            )
        max_new = min(params.max_new_tokens, ctx - len(ids))
        if not self.cache.can_ever_fit(len(ids) + max_new):
            raise ValueError(
                f"a request of {len(ids) + max_new} tokens needs {self.cache.pages_needed(len(ids) + max_new)} KV pages "
                f"but the whole pool has {self.cache.pool.num_pages}: raise --kv-budget-gb or lower --max-new-tokens"
            )
        params = SamplingParams(**{**params.__dict__, "max_new_tokens": max_new})
        req = Request(next(self._ids), ids, params, on_text)
        if params.seed is not None:
            req.generator = torch.Generator(self.device).manual_seed(params.seed)
        return req

    def enqueue(self, req: Request) -> None:
        """Queue a request made by new_request; it is admitted in a later step, first come first served."""
        if not self.has_work():  # a new run begins: kv_stats' "last run" is the one before it
            self._finished_lengths = []
        self.waiting.append(req)
        self._tell(op="add", id=req.id, ids=req.prompt_ids, params=req.params.__dict__)

    def cancel(self, req: Request) -> None:
        """Stop a request now; its pages go back to the pool."""
        self._tell(op="cancel", id=req.id)
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.prefilling:
            self.prefilling.remove(req)
        if req.slot is not None:
            self._retire(req)
        req.finish_reason = req.finish_reason or "cancelled"

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self._in_flight)

    # ---- the loop ---------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Admit what fits, prefill the next prompt chunk(s), launch one decode step for the
        running sequences, then read the tokens of every earlier launch; returns the requests
        that finished."""
        self._lead("step")
        return self._step()

    def _step(self) -> list[Request]:
        while self.waiting:
            req = self.waiting[0]
            slot = self.cache.admit(len(req.prompt_ids) + req.params.max_new_tokens)
            if slot is None:
                break  # no pages or slots: wait for running sequences to finish (FIFO)
            self.waiting.popleft()
            req.slot = slot
            self.prefilling.append(req)
        prefill_left = self.config.prefill_chunk or math.inf  # prompt tokens this step may prefill
        while self.prefilling and prefill_left > 0:
            req = self.prefilling[0]
            start = req.n_prefilled
            n = min(prefill_left, len(req.prompt_ids) - start)
            last = start + n == len(req.prompt_ids)
            self._in_flight.append(self.runner.prefill(req, req.slot, req.prompt_ids[start:start + n],
                                                         sample_next=last))
            req.n_prefilled += n
            self.timing["prefill_tokens"] += n
            prefill_left -= n
            if last:  # its first token is sampled: it decodes from the next step
                self.prefilling.popleft()
                req.n_sampled = 1
                self.running.append(req)
        decoding = [r for r in self.running if not r.finished and 0 < r.n_sampled < r.params.max_new_tokens]
        if decoding:
            self._in_flight.append(self.runner.decode(decoding, [r.slot for r in decoding]))
            for r in decoding:
                r.n_sampled += 1
            self.timing["decode_steps"] += 1
            self.timing["decode_tokens"] += len(decoding)
        # The newest launch stays in flight (unless it is all there is to wait for), so the GPU
        # always has a step queued while the host streams text and retires requests.
        keep = 1 if decoding else 0
        while len(self._in_flight) > keep:
            self._read_tokens(self._in_flight.popleft())
        finished = [r for r in self.running if r.finished]
        self.running = [r for r in self.running if not r.finished]
        return finished

    def _read_tokens(self, launched: Launched) -> None:
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
        self._finished_lengths.append(self.cache.stored_tokens(req.slot))
        self.cache.release(req.slot)
        req.slot = None

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | None = None,
                 on_text: Callable[[Request, str], None] | None = None, progress: bool = False) -> list[Request]:
        """Run prompts to completion as one continuously batched workload; results in prompt order."""
        reqs = [self.add_request(p, params, on_text) for p in prompts]
        return self.run(reqs, progress)

    def run(self, reqs: list[Request], progress: bool = False) -> list[Request]:
        """Step until every queued request has finished; returns reqs. progress: bars on stderr
        for the requests (two or more) and for a prefill long enough to take several steps."""
        chunk = self.config.prefill_chunk
        prompt_tokens = sum(len(r.prompt_ids) for r in reqs)
        requests_bar = _progress(len(reqs), progress and len(reqs) > 1, "requests", "req")
        prefill_bar = _progress(prompt_tokens, progress and chunk and prompt_tokens > 2 * chunk, "prefill", "tok")
        prefilled = self.timing["prefill_tokens"]
        while self.has_work():
            done = self.step()
            if requests_bar and done:
                requests_bar.update(len(done))
            if prefill_bar:
                prefill_bar.update(self.timing["prefill_tokens"] - prefilled)
                prefilled = self.timing["prefill_tokens"]
                if not self.waiting and not self.prefilling:
                    prefill_bar.close()
                    prefill_bar = None
        for bar in (requests_bar, prefill_bar):
            if bar:
                bar.close()
        return reqs

    def kv_stats(self) -> dict:
        """Bytes held by each KV tier, per layer and in total, and bits per cached element, with
        `scope` saying over what: the sequences in the cache ("live"); when there are none, the
        sequences of the last run as they stood when they finished ("last run"); before any run,
        the format's page bits stand in for bits_per_element ("page bits").

        With tensor parallelism the tier bytes are those of all ranks (each holds its share of
        the KV heads, all shares alike), `per_rank` has this rank's, and the pool's pages and the
        per-layer figures are per rank (a page holds one rank's heads)."""
        stats = self.cache.kv_stats()
        if stats["total"] or self.has_work():
            stats = {**stats, "scope": "live"}
        elif self._finished_lengths:
            stats = {**self.cache.kv_stats(lengths=self._finished_lengths), "scope": "last run"}
        else:
            stats = {**stats, "bits_per_element": stats["page_bits_per_element"], "scope": "page bits"}
        ranks = self.tp.size if self.tp else 1
        per_rank = {tier: stats[tier] for tier in ("sink", "pages", "recent", "total")}
        return {**stats, **{tier: n * ranks for tier, n in per_rank.items()}, "ranks": ranks, "per_rank": per_rank}

    def reset_timing(self) -> None:
        """Zero the counters of `timing`: prefill seconds (measured on the device) and tokens,
        decode steps and tokens."""
        self.timing = {"prefill_s": 0.0, "prefill_tokens": 0, "decode_steps": 0, "decode_tokens": 0}

    # ---- hooks for benchmarks and tests -------------------------------------------------------

    def teacher_force(self, ids: list[int], blocks: list[int]) -> torch.Tensor:
        """Logits [sum(blocks), V] of feeding ids through the cache as one sequence, in blocks of
        these sizes (1 = a decode step, every page then written by the decode path): what
        quality benchmarks score. The sequence is admitted here and released afterwards."""
        if sum(blocks) > len(ids):
            raise ValueError(f"blocks of {sum(blocks)} tokens in all, but only {len(ids)} ids")
        self._lead("teacher_force", ids=list(ids), blocks=list(blocks))
        return self._teacher_force(ids, blocks)

    def _teacher_force(self, ids: list[int], blocks: list[int]) -> torch.Tensor:
        slot = self.cache.admit(sum(blocks))
        if slot is None:
            raise ValueError("no free slot or too few free pages for a teacher-forced sequence")
        try:
            return self.runner.logits(slot, ids, blocks)
        finally:
            self.cache.release(slot)

    def add_synthetic(self, n_tokens: int, params: SamplingParams) -> Request:
        """A request that holds n_tokens of context already, whatever the cache's tiers contain
        (KVCache.randomize), and has sampled its first token: it decodes from the next step.
        Capacity benchmarks run hundreds of long sequences this way without prefilling them."""
        return self._add_synthetic(next(self._ids), n_tokens, params)

    def _add_synthetic(self, id: int, n_tokens: int, params: SamplingParams) -> Request:
        slot = self.cache.admit(n_tokens + params.max_new_tokens)
        if slot is None:
            raise ValueError(f"no room for a synthetic sequence of {n_tokens} + {params.max_new_tokens} tokens")
        self._tell(op="synthetic", id=id, n_tokens=n_tokens, params=params.__dict__)
        self.cache.assume_stored(slot, n_tokens)
        req = Request(id, [0] * n_tokens, params, output_ids=[0], slot=slot, n_sampled=1)
        self.running.append(req)
        return req

    # ---- tensor parallel: rank 0 leads, the other ranks follow -------------------------------

    def _tell(self, **op) -> None:
        """Rank 0: note a change of the scheduler's state that the followers must make too."""
        if self.tp and self.tp.leader:
            self._told.append(op)

    def _lead(self, then: str, **args) -> None:
        """Rank 0, before it runs something on the model: one message that brings the followers'
        schedulers to its state and tells them to run the same (a follower calling this is a bug)."""
        if self.tp is None:
            return
        if not self.tp.leader:
            raise RuntimeError(f"rank {self.tp.rank} follows rank 0: call follow(), not the engine's loop")
        self.tp.send({"told": self._told, "then": then, **args})
        self._told = []

    def follow(self) -> None:
        """Ranks 1.. of a tensor-parallel group: make every change and run every step that rank
        0's LLM makes, on this rank's slice, until rank 0 calls close(). Raises tp.RankLost if rank
        0 dies meanwhile."""
        if self.is_leader:
            raise RuntimeError("follow() is for ranks 1.. of a tensor-parallel group; rank 0 drives the engine")
        while True:
            message = self.tp.receive()
            for op in message["told"]:
                self._apply(op)
            if message["then"] == "step":
                self._step()
            elif message["then"] == "teacher_force":
                try:
                    self._teacher_force(message["ids"], message["blocks"])
                except ValueError:  # no room: rank 0 raised the same to its caller, and goes on
                    pass
            elif message["then"] == "close":
                self.tp.barrier()
                return

    def _apply(self, op: dict) -> None:
        params = SamplingParams(**op.get("params", {}))
        if op["op"] == "add":
            req = Request(op["id"], op["ids"], params)
            if params.seed is not None:
                req.generator = torch.Generator(self.device).manual_seed(params.seed)
            self.enqueue(req)
        elif op["op"] == "cancel":
            for req in itertools.chain(self.waiting, self.prefilling, self.running):
                if req.id == op["id"]:
                    self.cancel(req)
                    break
        elif op["op"] == "synthetic":
            self._add_synthetic(op["id"], op["n_tokens"], params)

    def close(self) -> None:
        """Rank 0 of a tensor-parallel group: release the followers from follow(). Nothing to do
        on one GPU; a second call does nothing."""
        if not self._closed and self.tp and self.tp.leader:
            self._lead("close")
            self.tp.barrier()
        self._closed = True


def available_cpus() -> int:
    """CPUs this process may really use: its affinity mask, capped by a cgroup CPU quota (containers,
    CI). On a 16-core machine every thread helps (SmolLM2-135M shape, batch 1: 12.7 tok/s with one
    thread, 23.1 with 16; a 512-token prefill 1.9 s -> 0.23 s); what hurts is more threads than
    CPUs, where each of a decode step's thousands of tiny ops waits for descheduled threads."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, min(cpus, torch.get_num_threads()))


def default_kv_budget(device: torch.device) -> int:
    """Most of the free GPU memory on CUDA; a modest 1 GiB on the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    return 2**30


def _progress(total: int, enabled: bool, desc: str, unit: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)
