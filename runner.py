"""The model runner: runs the model over the KV cache for the scheduler (llm.py) and hands back
the sampled tokens without making the host wait.

A prefill runs one prompt (or one chunk of it) alone; a decode step runs every running sequence's last token. Decode
steps are captured once per batch-size bucket and page-table width in CUDA graphs (DecodeGraphs), so a step is one
replay instead of hundreds of kernel launches from Python. Sampled tokens stay on the GPU, where
the next step reads them; a copy goes to a pinned host buffer, with an event that says when it
has arrived (Launched), so the host reads a step's tokens while the GPU runs the next one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

import kernels
import tp as tp_group
from kvcache import KVCache
from kvcache.cache import to_device
from model import Transformer
from sampling import Sampled, sample


class ModelRunner:
    """Runs prefills and decode steps of one model over one cache; owns the device buffer of each
    slot's last token and the decode graphs."""

    def __init__(self, model: Transformer, cache: KVCache, max_batch: int, cuda_graphs: bool,
                 tp: tp_group.Group | None = None):
        """tp: this rank's group; sampled (not greedy) tokens are then rank 0's on every rank."""
        self.model, self.cache, self.tp = model, cache, tp
        self.device = cache.device
        # The last sampled token of each cache slot (the extra row is the cache's scratch slot):
        # a decode step reads its input ids here, on the device.
        self.last_tokens = torch.zeros(max_batch + 1, dtype=torch.long, device=self.device)
        self.graphs = DecodeGraphs(cache, max_batch) if cuda_graphs else None
        self._decode_out = [_HostTokens(max_batch, self.device) for _ in range(2)]  # alternate steps
        self._decode_parity = 0

    @torch.inference_mode()
    def prefill(self, req: Sampled, slot: int, ids: list[int], sample_next: bool = True) -> Launched:
        """Run prompt tokens into a slot (the whole prompt, or its next chunk after the ones
        already stored) and, after the last chunk, sample the first token. Timed on the device;
        the host does not wait for it."""
        timer = _DeviceTimer(self.device)
        positions = self.cache.begin_step([slot], len(ids))
        logits = self.model(to_device([ids], self.device), positions, cache=self.cache, last_only=True)[:, -1]
        self.cache.end_step()
        if not sample_next:
            return Launched(None, [], timer.stop())
        tokens = sample(logits, [req])
        if self.tp:
            self.tp.broadcast(tokens)
        self.last_tokens[slot] = tokens[0]
        return _HostTokens(1, self.device).launch(tokens, [req], timer.stop())

    @torch.inference_mode()
    def decode(self, reqs: list[Sampled], slots: list[int]) -> Launched:
        """One decode step of these slots (each fed its last token); samples the next tokens."""
        B = len(reqs)
        if self.graphs:
            table_pages = self.cache.decode_table_pages(slots)
            key = self.graphs.for_step(B, table_pages, self._decode_forward)
            self.cache.prepare_step(slots, 1, key.rows, table_pages)
            logits, tokens = self.graphs.replay(key)
        else:
            self.cache.prepare_step(slots, 1)
            logits, tokens = self._decode_forward(B)
        slots_t = self.cache.step_slots
        self.cache.end_step()
        if any(r.params.temperature > 0 for r in reqs):
            sample(logits[:B], reqs, greedy=tokens[:B])
            if self.tp:  # greedy tokens agree already: every rank has the same gathered logits
                self.tp.broadcast(tokens)
            self.last_tokens.index_copy_(0, slots_t, tokens)
        out = self._decode_out[self._decode_parity]
        self._decode_parity ^= 1
        return out.launch(tokens[:B], reqs)

    def _decode_forward(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of the first `rows` step slots in device ops only, so that a CUDA graph
        can capture it: input ids and positions come from device buffers, the greedy tokens go
        back to them. Returns logits [rows, V] and greedy tokens [rows]."""
        slots = self.cache.step_slots
        positions = self.cache.step_positions()
        logits = self.model(self.last_tokens[slots][:, None], positions, cache=self.cache)[:, -1]
        tokens = kernels.argmax(logits)
        self.last_tokens.index_copy_(0, slots, tokens)
        return logits, tokens

    @torch.inference_mode()
    def logits(self, slot: int, ids: list[int], blocks: list[int]) -> torch.Tensor:
        """Logits [sum(blocks), V] of feeding ids to an admitted slot in blocks of these sizes
        (1 = a decode step), eagerly: teacher forcing, where every position's output counts."""
        x = to_device([ids], self.device)
        out, pos = [], 0
        for size in blocks:
            positions = self.cache.begin_step([slot], size)
            out.append(self.model(x[:, pos:pos + size], positions, cache=self.cache)[0])
            self.cache.end_step()
            pos += size
        return torch.cat(out)


class GraphKey(NamedTuple):
    """Which decode graph runs a step: the attention's launch depends on both fields."""

    rows: int  # the batch bucket
    table_pages: int  # page-table columns the attention sees (KVCache.decode_table_pages)


class DecodeGraphs:
    """One CUDA graph per batch-size bucket and page-table width (the attention's launch depends
    on both) for the decode forward. The graph reads everything from fixed device buffers (last
    tokens, slots, lengths; prepare_step refreshes the slots when they change) and a batch smaller
    than its bucket is padded with the cache's scratch slot. The graphs share one memory pool.
    The forward is passed at capture, not kept: holding the runner's bound method would make a
    reference cycle that keeps a dropped LLM's GPU memory alive until the garbage collector runs."""

    def __init__(self, cache: KVCache, max_batch: int):
        self.cache = cache
        self.buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_batch] + [max_batch]
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.pool = None

    def for_step(self, batch: int, table_pages: int,
                 forward: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> GraphKey:
        """The graph that runs a batch whose attention sees table_pages columns of the page table;
        on first use, `forward(rows)` is captured (before the caller's prepare_step)."""
        key = GraphKey(next(b for b in self.buckets if b >= batch), table_pages)
        if key not in self.graphs:
            self._capture(key, forward)
        return key

    def replay(self, key: GraphKey) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and greedy tokens of the step prepared for this graph."""
        graph, outputs = self.graphs[key]
        graph.replay()
        return outputs

    def _capture(self, key: GraphKey, forward: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.cache.prepare_step([], 1, key.rows, key.table_pages)  # every row on the scratch slot
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS picks kernels
            for _ in range(2):
                forward(key.rows)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = forward(key.rows)
        self.pool = graph.pool()
        self.graphs[key] = (graph, outputs)


class _HostTokens:
    """A pinned host buffer that sampled tokens are copied into without waiting for the GPU,
    and the event that says when they have arrived."""

    def __init__(self, size: int, device: torch.device):
        self.cuda = device.type == "cuda"
        self.buffer = torch.zeros(size, dtype=torch.long, pin_memory=self.cuda)
        self.event = torch.cuda.Event() if self.cuda else None

    def launch(self, tokens: torch.Tensor, reqs: list, timer: _DeviceTimer | None = None) -> Launched:
        self.buffer[: len(reqs)].copy_(tokens, non_blocking=True)
        if self.cuda:
            self.event.record()
        return Launched(self, reqs, timer)


@dataclass
class Launched:
    """Tokens sampled for these requests, on their way to the host (out None: a prefill chunk
    that sampled nothing, kept for its timer)."""

    out: _HostTokens | None
    reqs: list
    timer: _DeviceTimer | None = None

    def wait(self) -> list[int]:
        if self.out is None:
            return []
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

    def stop(self) -> _DeviceTimer:
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
