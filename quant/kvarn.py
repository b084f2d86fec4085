"""KVarN: rotate K and V with a Walsh-Hadamard matrix, balance the tile, then plain RTN.

1. Rotation (hadamard.py). Pages store K @ Hd and V @ Hd; attention rotates q the same way
   (q Hd . k Hd = q . k) and maps its output back with Hd (Hd^T = Hd). The rotation spreads
   outlier channels over all channels.
2. Sinkhorn dual scaling per (head) tile y[T, D]: alternately divide columns, then rows, by
   their standard deviation, accumulating the scales in the log domain with every std clamped
   to [1e-3, 1e3]; after each round measure the imbalance (max/min std over columns plus
   max/min std over rows) and keep the best-balanced scales. y = r[t] * c[d] * balanced[t, d].
3. RTN of the balanced tile, with one of the two scales absorbed into the RTN range:
   keys per channel over tokens (c is absorbed, r is stored), values per token over channels
   (r is absorbed, c is stored). The stored scale multiplies the logit (K) or the
   probability-weighted value (V) inside the kernel.

    K: {"codes": packed [H, T*b/8, D], "scale": f16 [H, D], "zero": f16 [H, D], "token_scale": f16 [H, T]}
       y[t, d] ~= token_scale[t] * (code * scale[d] + zero[d])
    V: {"codes": packed [H, T*b/8, D], "scale": f16 [H, T], "zero": f16 [H, T], "channel_scale": f16 [H, D]}
       y[t, d] ~= channel_scale[d] * (code * scale[t] + zero[t])

(3-bit codes: "codes" [H, T/4, D] holds their two low bits and "high" [H, T/8, D] the third, rtn.py.)
encode takes the un-rotated tile; decode returns the rotated-domain values (y = x @ Hd).
Presets: kvarn (K2V2) and kvarn-k4v2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import PAGE_TOKENS, FieldSpecs, KVFormat, TileCodec
from .hadamard import fwht
from .layout import Layout
from .rtn import HIGH_PLANE, dequantize, pack_planes, plane_specs, quantize, unpack_planes

STD_CLAMP = (1e-3, 1e3)


def _std(y: Tensor, dim: int) -> Tensor:
    return y.std(dim, correction=0).clamp(*STD_CLAMP)


def imbalance(y: Tensor) -> Tensor:
    """[..., T, D] -> [...]: max/min std over columns plus max/min std over rows."""
    col, row = _std(y, -2), _std(y, -1)
    return col.amax(-1) / col.amin(-1) + row.amax(-1) / row.amin(-1)


def _divide(y: Tensor, log_r: Tensor, log_c: Tensor) -> Tensor:
    return y * torch.exp(-log_r.unsqueeze(-1) - log_c.unsqueeze(-2))


def sinkhorn(y: Tensor, iters: int = 8) -> tuple[Tensor, Tensor]:
    """Row scales r [..., T] and column scales c [..., D] of the best-balanced y / (r c)."""
    log_r, log_c = y.new_zeros(y.shape[:-1]), y.new_zeros(y.shape[:-2] + y.shape[-1:])
    best_r, best_c, best = log_r, log_c, imbalance(y)
    for _ in range(iters):
        log_c = log_c + _std(_divide(y, log_r, log_c), -2).log()
        log_r = log_r + _std(_divide(y, log_r, log_c), -1).log()
        score = imbalance(_divide(y, log_r, log_c))
        # per tile, keep the best round; "best" needs a clear margin (1e-3) so that rounding noise
        # between devices does not pick a different round once the iteration has converged
        better = score < best * (1 - 1e-3)
        best = torch.where(better, score, best)
        best_r = torch.where(better.unsqueeze(-1), log_r, best_r)
        best_c = torch.where(better.unsqueeze(-1), log_c, best_c)
    return best_r.exp(), best_c.exp()


def _f16_scale(s: Tensor) -> Tensor:
    """A positive scale as stored (fp16, kept in the normal range so dividing by it is safe)."""
    return s.clamp(2**-14, 6e4).half()


@dataclass(frozen=True)
class KVarNCodec(TileCodec):
    bits: int
    per_channel: bool  # True for keys (RTN per channel, token scale stored), False for values
    iters: int = 8
    rotated = True

    def field_specs(self, heads: int, head_dim: int, tokens: int = PAGE_TOKENS) -> FieldSpecs:
        planes = plane_specs(heads, tokens, head_dim, self.bits)
        rtn, kept = ((heads, head_dim), (heads, tokens)) if self.per_channel else ((heads, tokens), (heads, head_dim))
        return {
            **planes,
            "scale": (rtn, torch.float16),
            "zero": (rtn, torch.float16),
            ("token_scale" if self.per_channel else "channel_scale"): (kept, torch.float16),
        }

    def encode(self, x: Tensor) -> dict[str, Tensor]:
        y = fwht(x)
        r, c = sinkhorn(y, self.iters)
        if self.per_channel:
            kept = _f16_scale(r)
            codes, scale, zero = quantize(y / kept.float().unsqueeze(-1), self.bits, dim=-2)
            return {**pack_planes(codes, self.bits), "scale": scale, "zero": zero, "token_scale": kept}
        kept = _f16_scale(c)
        codes, scale, zero = quantize(y / kept.float().unsqueeze(-2), self.bits, dim=-1)
        return {**pack_planes(codes, self.bits), "scale": scale, "zero": zero, "channel_scale": kept}

    def decode(self, fields: dict[str, Tensor]) -> Tensor:
        codes = unpack_planes(fields, self.bits)
        if self.per_channel:
            kept = fields["token_scale"]
            return dequantize(codes, fields["scale"], fields["zero"], dim=-2) * kept.float().unsqueeze(-1)
        kept = fields["channel_scale"]
        return dequantize(codes, fields["scale"], fields["zero"], dim=-1) * kept.float().unsqueeze(-2)

    def kernel_layout(self, heads: int, head_dim: int, tokens: int = PAGE_TOKENS) -> Layout:
        encode = dict(rotate=True, sinkhorn_iters=self.iters)
        high = HIGH_PLANE if self.bits == 3 else None
        if self.per_channel:  # keys: RTN per channel, the stored per-token factor multiplies the logit
            fields = ("codes", "scale", "zero", "token_scale", high, None)
            return Layout.with_channel_scales(self.bits, heads, head_dim, tokens, fields, mult_kind=1, **encode)
        fields = ("codes", "scale", "zero", "channel_scale", high, None)  # values: one RTN range per token
        return Layout.with_token_scales(self.bits, heads, head_dim, tokens, 1, fields, mult_kind=2, **encode)


def kvarn_format(name: str, k_bits: int, v_bits: int, iters: int = 8) -> KVFormat:
    return KVFormat(name, KVarNCodec(k_bits, per_channel=True, iters=iters), KVarNCodec(v_bits, per_channel=False, iters=iters))
