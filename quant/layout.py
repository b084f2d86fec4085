"""How a page's fields are addressed: the description the kernels read.

Every quantized page of every format decodes, per kv head, token t and channel d, as

    x[t, d] = (level(code[t, d]) * scale + zero) * mult        (Kitty adds 4 * scale * high[t, rank])

with code read from a plane packed along tokens ("split" layout, rtn.py), level either the
identity (RTN) or a 16-entry table (NF4), scale/zero either per channel or per token and
group of channels, and mult an optional per-token (KVarN keys) or per-channel (KVarN values)
factor. A `Layout` holds the compile-time constants that pick these options and the strides
of the fields, so the attention and encode kernels have one code path parameterised by them
instead of one copy per format. Each codec states its own (TileCodec.kernel_layout), so the
kernels never ask which method wrote a page. The pool stores each field contiguously
([num_pages, *shape]), which is what the strides assume.

Encoding runs a few stages before the range that decoding does not undo in the kernel
(KVarN's Sinkhorn balance, Kitty's channel score); the encode-only fields describe them and
attention ignores them. The rotation it does undo: rotated pages meet a rotated q, and their
output is rotated back.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .rtn import code_rows

# the page fields a kernel addresses, in the order of Layout.fields
FIELD_SLOTS = ("CODES", "SCALE", "ZERO", "MULT", "HIGH", "IDS")


@dataclass(frozen=True)
class Layout:
    """Constants of one codec at a given (heads, head_dim, tokens); see the module docstring."""

    bits: int  # 16 = raw fp16 values, else code width (2, 3, 4; 3: a 2-bit plane and the HIGH 1-bit plane, rtn.py)
    rows: int  # code rows per head: token t sits in row t % rows, slot t // rows (3 bits: the 2-bit plane's)
    per_token: bool  # scale/zero per (token, group) instead of per channel
    s_page: int  # scale/zero strides (elements): per page,
    s_head: int  # per (kv head // hdiv),
    s_tok: int  # per token (per_token only)
    hdiv: int  # kv heads sharing one scale column group (NF4 blocks wider than a head)
    group: int  # channels per scale group (per_token only)
    fields: tuple[str | None, ...]  # field names for FIELD_SLOTS (None: the format has no such field)
    has_zero: bool = True
    mult_kind: int = 0  # 0 none, 1 per-token factor [H, T], 2 per-channel factor [H, D]
    nf4: bool = False  # level(code) = NF4 table lookup
    n_high: int = 0  # Kitty: boosted channels with a sparse high plane (0: none)
    channel_major: bool = False  # code plane stored [D, rows] (ChannelMajor: value pages) instead of [rows, D]
    columns_swapped: bool = False  # its columns stored 0 2 1 3 in every four (SwappedColumns: key pages)
    rotate: bool = False  # pages hold x @ Hd (KVarN; kitty-qh's values): attention rotates q / un-rotates its output
    # encode only (attention ignores them)
    sinkhorn_iters: int = 0  # rounds of Sinkhorn balance, whose kept factor becomes mult (KVarN; 0: none)
    channel_score: int = 0  # how n_high channels are ranked: 0 mean |x|, 1 range (max - min), 2 range x mean |q|
    encode_unsupported: str = ""  # why the encode kernel cannot write these pages ("": it can)

    def __post_init__(self):
        # the attention kernel folds mult along the axis that scale/zero do not use
        if self.mult_kind not in (0, 2 if self.per_token else 1):
            raise ValueError(f"mult_kind {self.mult_kind} must lie across the scales (per_token={self.per_token})")

    @classmethod
    def with_channel_scales(cls, bits: int, heads: int, head_dim: int, tokens: int,
                            fields: tuple[str | None, ...], **options) -> Layout:
        """scale/zero [H, D]: one per channel over the page's tokens (16 bits: raw values, one row per token)."""
        rows = tokens if bits == 16 else code_rows(bits, tokens)
        return cls(bits, rows, False, heads * head_dim, head_dim, 0, 1, 1, fields, **options)

    @classmethod
    def with_token_scales(cls, bits: int, heads: int, head_dim: int, tokens: int, groups: int,
                          fields: tuple[str | None, ...], **options) -> Layout:
        """scale/zero [H, T, groups]: one per token and group of head_dim / groups channels."""
        return cls(bits, code_rows(bits, tokens), True, heads * tokens * groups, tokens * groups, groups, 1,
                   head_dim // groups, fields, **options)

    @property
    def code_planes(self) -> tuple[str, ...]:
        """The fields that hold codes of every channel, packed along tokens: the code plane, and for
        3-bit codes the plane of their high bit (Kitty's HIGH plane holds only its boosted channels)."""
        return (self.fields[0], self.fields[4]) if self.bits == 3 else (self.fields[0],)

    def constexprs(self, prefix: str) -> dict[str, int]:
        """The constants every kernel takes (not the encode-only ones) as keyword arguments, prefixed
        with e.g. 'K_' or 'V_'."""
        names = ("bits", "rows", "per_token", "s_page", "s_head", "s_tok", "hdiv", "group", "has_zero",
                 "mult_kind", "nf4", "n_high", "channel_major", "columns_swapped", "rotate")
        return {f"{prefix}{n.upper()}": int(getattr(self, n)) for n in names}

    def pointers(self, pages: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
        """The fields as kernel pointer arguments; a missing one is replaced by the codes plane
        (never read: the constexprs switch its use off)."""
        codes = pages[self.fields[0]]
        for name in self.fields:
            if name is not None and not pages[name].is_contiguous():
                raise ValueError(f"page field {name!r} must be contiguous (pool layout [num_pages, *shape])")
        return {f"{prefix}{s}": pages[n] if n is not None else codes for s, n in zip(FIELD_SLOTS, self.fields)}
