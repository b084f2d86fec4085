"""kernels: tiered decode attention and page encoding, in Triton and as a torch reference.

    kernels.decode_attention(q, fmt, kernels.Tiers(sink_k, sink_v, n_sink, k_pages, v_pages,
                             page_table, n_pages, recent_k, recent_v, n_recent, slots), scale,
                             window=None, return_lse=False, backend=None)
        -> o, or (o, lse) with return_lse                 # arguments: kernels/reference.py
    kernels.encode_pages(codec, x, pool_fields, page_ids, backend=None, rows=None)
                                                         # x [N, H, T, D] (or x[rows]) -> pages, in place
    kernels.causal_attention(q, k, v, window=None)       # a forward's new tokens (after any stored ones)
    kernels.rms_norm(x, weight, eps), kernels.add_rms_norm(x, h, weight, eps) -> (x + h, its norm),
    kernels.apply_rope(x, cos, sin), kernels.silu_mul(gate, up)
                                                         # the model's per-token arithmetic
    kernels.rope_store(q, k, v, cos, sin, dense_k, dense_v, slots, index) -> rotated q
                                                         # a decode step's RoPE, and its K, V into the dense tier
    kernels.linear(x, weight, bias)                      # F.linear; decode shapes on CUDA: the fastest
                                                         # of cuBLAS and a Triton GEMV, measured (matmul.py)
    kernels.argmax(x)                                    # greedy tokens: each row's first maximum

backend: "triton" or "torch"; None picks triton for CUDA tensors and torch otherwise.
Triton on CPU tensors runs under the Triton interpreter (slow; for tests): whether a kernel is
interpreted is fixed when its module is imported, so the Triton modules are imported lazily
and, for a CPU call, with TRITON_INTERPRET=1 set first.

Both backends support every quant/ format and every option above (Triton needs a power-of-2
head dim); each codec describes its page fields itself (codec.kernel_layout, quant/layout.py).
Files: reference.py (torch oracle, off-GPU path), attention.py, quantize.py, elementwise.py,
gemv.py, greedy.py (Triton), matmul.py (the per-shape choice of matmul kernel), pdl.py (how
the decode kernels overlap their launches: programmatic dependent launch).
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import torch
from torch import Tensor

from . import reference

BACKENDS = ("triton", "torch")


def pick_backend(device: torch.device, backend: str | None = None) -> str:
    """The backend to use for tensors on `device`: the requested one, or triton on CUDA, torch elsewhere."""
    if backend is None:
        return "triton" if device.type == "cuda" else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {BACKENDS}")
    return backend


def _triton_module(name: str, device: torch.device) -> ModuleType:
    """kernels.attention, .quantize, .elementwise or .greedy, imported for this device (interpreted on CPU)."""
    full = f"{__name__}.{name}"
    if device.type != "cuda" and full not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        module = importlib.import_module(full)
    except ModuleNotFoundError as e:
        if e.name != "triton":
            raise
        raise ValueError("the Triton kernels need the triton package (pip install triton; torch's CUDA wheels "
                         "bring it): install it, or use --backend torch") from None
    if module.INTERPRETED != (device.type != "cuda"):
        how = "with" if module.INTERPRETED else "without"
        raise RuntimeError(f"{full} was imported {how} TRITON_INTERPRET=1 and cannot run on {device.type} tensors "
                           "in this process")
    return module


def _implementation(triton_module: str, device: torch.device, backend: str | None) -> ModuleType:
    """Where a kernel's function lives for this device: reference.py, or the Triton module of
    the same function names."""
    if pick_backend(device, backend) == "torch":
        return reference
    return _triton_module(triton_module, device)


def decode_attention(q: Tensor, fmt, tiers: Tiers, scale: float, *, window: int | None = None,
                     return_lse: bool = False, backend: str | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of q [B, Hq, D] (or [B, Hq, T, D]) over the sink, page and recent tiers of each row.
    window / return_lse: see reference.decode_attention."""
    implementation = _implementation("attention", q.device, backend)
    return implementation.decode_attention(q, fmt, tiers, scale, window=window, return_lse=return_lse)


def encode_pages(codec, x: Tensor, pool_fields: dict[str, Tensor], page_ids: Tensor,
                 backend: str | None = None, query_weight: Tensor | None = None, rows: Tensor | None = None) -> None:
    """Encode tiles x [N, H, T, D] with `codec` into pool pages page_ids [N], in place.
    query_weight [N, H, D]: the mean |q| per channel, for a codec that needs_queries.
    rows [N]: the tiles are x[rows] (read in place, e.g. from the cache's recent tier)."""
    if pick_backend(x.device, backend) == "torch":
        reference.encode_pages_reference(codec, x, pool_fields, page_ids, query_weight, rows)
    else:
        _triton_module("quantize", x.device).encode_pages(codec, x, pool_fields, page_ids, query_weight, rows)


def rms_norm(x: Tensor, weight: Tensor, eps: float, backend: str | None = None) -> Tensor:
    """RMSNorm over the last dim of x."""
    return _implementation("elementwise", x.device, backend).rms_norm(x, weight, eps)


def add_rms_norm(x: Tensor, h: Tensor, weight: Tensor, eps: float,
                 backend: str | None = None) -> tuple[Tensor, Tensor]:
    """The residual add and the RMSNorm after it: (x + h, rms_norm(x + h))."""
    return _implementation("elementwise", x.device, backend).add_rms_norm(x, h, weight, eps)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, backend: str | None = None) -> Tensor:
    """Rotary embedding of x [B, H, T, D] by cos/sin [B, 1, T, D] (rotate_half convention)."""
    return _implementation("elementwise", x.device, backend).apply_rope(x, cos, sin)


def silu_mul(gate: Tensor, up: Tensor, backend: str | None = None) -> Tensor:
    """SiLU(gate) * up."""
    return _implementation("elementwise", gate.device, backend).silu_mul(gate, up)


def rope_store(q: Tensor, k: Tensor, v: Tensor, cos: Tensor | None, sin: Tensor | None, dense_k: Tensor,
               dense_v: Tensor, slots: Tensor, index: Tensor, backend: str | None = None) -> Tensor:
    """A decode step's rotary embedding and K/V store: q [B, Hq, D] and k [B, H, D] rotated by
    cos/sin [B, D] (None: no rotation), the rotated k and v of row b written into
    dense_k/v[slots[b], :, index[b]] in place; returns the rotated q."""
    return _implementation("elementwise", q.device, backend).rope_store(q, k, v, cos, sin, dense_k, dense_v, slots,
                                                                         index)


def argmax(x: Tensor, backend: str | None = None) -> Tensor:
    """Index of each row's maximum, x [rows, n] -> int64 [rows] (the first on ties, as torch.argmax)."""
    return _implementation("greedy", x.device, backend).argmax(x)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias). On CUDA, inputs of at most 16 rows (decode) take whichever of
    cuBLAS and the Triton GEMV measured fastest for this weight shape."""
    if x.device.type != "cuda":
        return torch.nn.functional.linear(x, weight, bias)
    return _triton_module("matmul", x.device).linear(x, weight, bias)


Tiers = reference.Tiers
causal_attention = reference.causal_attention

__all__ = ["BACKENDS", "Tiers", "add_rms_norm", "argmax", "apply_rope", "causal_attention", "decode_attention", "encode_pages", "linear", "pick_backend",
           "reference", "rms_norm", "rope_store", "silu_mul"]
