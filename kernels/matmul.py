"""Decode-shaped matmuls: for each weight shape, the fastest of cuBLAS and kernels/gemv.py's tiles,
measured on this GPU the first time the shape is seen.

A decode step's matmuls have 1 to 16 rows, so each is a read of its weight and its time is
bytes over achieved bandwidth. cuBLAS's choice for these shapes reaches 2.0-2.8 TB/s on an
H100 (the small square ones worst); a GEMV that streams weight rows can do better, but which
tile wins depends on the shape and the GPU. So `linear` times the candidates once per
(one row or several, weight shape, dtype, device), on a ring of weights larger than L2 (a
decode step never finds its weights in cache either), inside a CUDA graph as the engine runs
them, and keeps the winner. Inputs of more than 16 rows (prefill) and CPU tensors go to
F.linear. Tuning cannot run while a CUDA graph is being captured: the engine's warm-up
forward, which runs before every capture, tunes each shape first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .gemv import INTERPRETED, GemvConfig, gemv

MAX_ROWS = 16
CUBLAS = "cublas"
# Tiles worth trying, from a sweep over Llama-3-8B's shapes on an H100 (bench.py matmul prints
# this choice per shape): one input row uses multiply-adds, several use a 16-row MMA.
ONE_ROW_TILES = (GemvConfig(8, 1024, 8), GemvConfig(8, 512, 8), GemvConfig(16, 1024, 4), GemvConfig(16, 512, 4))
MULTI_ROW_TILES = (GemvConfig(32, 256, 4, 3), GemvConfig(32, 256, 4, 4), GemvConfig(64, 256, 4, 4),
                   GemvConfig(16, 256, 4, 4), GemvConfig(32, 128, 4, 3))
RING_BYTES = 160 * 2**20  # > 2x the 50 MB L2 of an H100

_chosen: dict[tuple, str | GemvConfig] = {}

__all__ = ["INTERPRETED", "candidates", "linear", "time_candidates"]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias), through the measured-fastest kernel when x has <= 16 rows on CUDA."""
    K = x.shape[-1]
    rows = x.numel() // K if K else 0
    if not x.is_cuda or not 0 < rows <= MAX_ROWS:
        return F.linear(x, weight, bias)
    key = _key(rows, weight)
    choice = _chosen.get(key)
    if choice is None:
        if torch.cuda.is_current_stream_capturing():
            return F.linear(x, weight, bias)  # untuned inside a capture: cuBLAS is always correct
        choice = _chosen[key] = min(time_candidates(rows, weight, bias), key=lambda c: c[1])[0]
    if choice == CUBLAS:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, K)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return gemv(flat, weight, bias, choice).view(*x.shape[:-1], weight.shape[0])


def _key(rows: int, weight: Tensor) -> tuple:
    return (rows == 1, tuple(weight.shape), weight.dtype, weight.device)


def candidates(rows: int) -> list[str | GemvConfig]:
    return [CUBLAS, *(ONE_ROW_TILES if rows == 1 else MULTI_ROW_TILES)]


def time_candidates(rows: int, weight: Tensor, bias: Tensor | None = None) -> list[tuple[str | GemvConfig, float]]:
    """(candidate, microseconds per matmul) for an input of `rows` rows against weights of this
    shape, each read from a ring of distinct weight buffers (RING_BYTES in all)."""
    N, K = weight.shape
    # at most 256 copies: a tiny test model's weights would otherwise need tens of thousands
    copies = min(255, max(0, -(-RING_BYTES // weight.nbytes) - 1))
    ring = [weight] + [torch.empty_like(weight) for _ in range(copies)]  # values do not change the time
    x = torch.randn(rows, K, device=weight.device, dtype=weight.dtype)
    results = []
    for c in candidates(rows):
        if c == CUBLAS:
            def call(w, c=c):
                F.linear(x, w, bias)
        else:
            def call(w, c=c):
                # without PDL (kernels/pdl.py): back-to-back copies of one GEMV would overlap each
                # other's start, which a decode step, where small kernels sit between them, never sees
                gemv(x, w, bias, c, pdl=False)
        results.append((c, _graph_time_us(call, ring)))
    return results


def _graph_time_us(call, ring: list[Tensor], min_calls: int = 16, replays: int = 3) -> float:
    """Microseconds per call of call(w) over the ring, captured in one CUDA graph (no launch gaps)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in ring:  # compile and warm up outside the graph
            call(w)
        torch.cuda.synchronize()
        calls = [ring[i % len(ring)] for i in range(max(min_calls, len(ring)))]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for w in calls:
                call(w)
        best = float("inf")
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            graph.replay()
            end.record(stream)
            end.synchronize()
            best = min(best, start.elapsed_time(end) * 1e3 / len(calls))
    torch.cuda.current_stream().wait_stream(stream)
    return best
