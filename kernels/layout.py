"""How the Triton kernels address a codec's page fields: one generic description for all formats.

Every quantized page of every format decodes, per kv head, token t and channel d, as

    x[t, d] = (level(code[t, d]) * scale + zero) * mult        (Kitty adds 4 * scale * high[t, rank])

with code read from a plane packed along tokens ("split" layout, quant/rtn.py), level either
the identity (RTN) or a 16-entry table (NF4), scale/zero either per channel or per token and
group of channels, and mult an optional per-token (KVarN keys) or per-channel (KVarN values)
factor. `Layout` holds the compile-time constants that pick these options and the strides of
the fields, so the attention and quantize kernels have one code path parameterised by them
instead of one copy per format. The pool stores each field contiguously ([num_pages, *shape]),
which is what the strides below assume.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from quant.nqkv import NF4_LEVELS, block_size


@dataclass(frozen=True)
class Layout:
    """Constants of one codec at a given (heads, head_dim, tokens); see the module docstring."""

    bits: int  # 16 = raw fp16 values, else code width (2, 3, 4)
    rows: int  # code rows per head: token t sits in row t % rows, slot t // rows
    per_token: bool  # scale/zero per (token, group) instead of per channel
    s_page: int  # scale/zero strides (elements): per page,
    s_head: int  # per (kv head // hdiv),
    s_tok: int  # per token (per_token only)
    hdiv: int  # kv heads sharing one scale column group (NF4 blocks wider than a head)
    group: int  # channels per scale group (per_token only)
    has_zero: bool
    mult_kind: int  # 0 none, 1 per-token factor [H, T], 2 per-channel factor [H, D]
    nf4: bool  # level(code) = NF4 table lookup
    n_high: int  # Kitty: boosted channels with a sparse high plane (0: none)
    fields: tuple[str | None, ...]  # field names for (codes, scale, zero, mult, high, ids)

    def __post_init__(self):
        # the attention kernel folds mult along the axis that scale/zero do not use
        if self.mult_kind not in (0, 2 if self.per_token else 1):
            raise ValueError(f"mult_kind {self.mult_kind} must lie across the scales (per_token={self.per_token})")

    def constexprs(self, prefix: str) -> dict[str, int]:
        """Kernel keyword arguments, prefixed with 'K_' or 'V_'."""
        names = ("bits", "rows", "per_token", "s_page", "s_head", "s_tok", "hdiv", "group", "has_zero",
                 "mult_kind", "nf4", "n_high")
        return {f"{prefix}{n.upper()}": int(getattr(self, n)) for n in names}

    def pointers(self, pages: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
        """The fields as kernel pointer arguments; a missing one is replaced by the codes plane
        (never read: the constexprs switch its use off)."""
        slots = ("CODES", "SCALE", "ZERO", "MULT", "HIGH", "IDS")
        codes = pages[self.fields[0]]
        for name in self.fields:
            if name is not None and not pages[name].is_contiguous():
                raise ValueError(f"page field {name!r} must be contiguous (pool layout [num_pages, *shape])")
        return {f"{prefix}{s}": pages[n] if n is not None else codes for s, n in zip(slots, self.fields)}


def code_rows(bits: int, tokens: int) -> int:
    """Rows of a packed code plane (quant/rtn.py): T*bits/8 bytes rows, or ceil(T/10) 3-bit words."""
    return -(-tokens // 10) if bits == 3 else tokens * bits // 8


def layout(codec, heads: int, head_dim: int, tokens: int) -> Layout:
    """The Layout of a quant codec (dispatch on codec.kind)."""
    H, D, T = heads, head_dim, tokens
    per_channel = dict(per_token=False, s_page=H * D, s_head=D, s_tok=0, hdiv=1, group=1)
    plain = dict(has_zero=True, mult_kind=0, nf4=False, n_high=0)
    if codec.kind == "fp16":
        return Layout(16, T, **per_channel, **plain, fields=("x", None, None, None, None, None))
    if codec.kind == "rtn_channel":
        return Layout(codec.bits, code_rows(codec.bits, T), **per_channel, **plain,
                      fields=("codes", "scale", "zero", None, None, None))
    if codec.kind == "rtn_token":
        groups = codec.n_groups(D)
        return Layout(codec.bits, code_rows(codec.bits, T), True, H * T * groups, T * groups, groups, 1, D // groups,
                      **plain, fields=("codes", "scale", "zero", None, None, None))
    if codec.kind == "kitty":
        return Layout(2, code_rows(2, T), **per_channel, has_zero=True, mult_kind=0, nf4=False, n_high=codec.n_boost(D),
                      fields=("low", "scale", "zero", None, "high", "ids"))
    if codec.kind == "kvarn":
        rows = code_rows(codec.bits, T)
        if codec.per_channel:  # keys: RTN per channel, stored per-token factor
            return Layout(codec.bits, rows, **per_channel, has_zero=True, mult_kind=1, nf4=False, n_high=0,
                          fields=("codes", "scale", "zero", "token_scale", None, None))
        return Layout(codec.bits, rows, True, H * T, T, 1, 1, D, has_zero=True, mult_kind=2, nf4=False, n_high=0,
                      fields=("codes", "scale", "zero", "channel_scale", None, None))
    if codec.kind == "nf4":
        b = block_size(H, D, codec.block)
        blocks = H * D // b
        # scale is [T, H*D/B]: head h's channels start at column h*D/B (B <= D) or share column h // (B/D)
        hdiv, s_head, group = (b // D, 1, D) if b >= D else (1, D // b, b)
        return Layout(4, code_rows(4, T), True, T * blocks, s_head, blocks, hdiv, group, has_zero=False, mult_kind=0,
                      nf4=True, n_high=0, fields=("codes", "scale", None, None, None, None))
    raise ValueError(f"no Triton layout for codec kind {codec.kind!r}")


@functools.lru_cache(maxsize=None)
def nf4_levels(device: torch.device) -> Tensor:
    """The NF4 table as a float32 tensor on `device` (the kernels look levels up in it)."""
    return NF4_LEVELS.to(device)
