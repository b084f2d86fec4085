"""KIVI: keys quantized per channel, values per token, by plain RTN.

Keys have a few channels of large magnitude that persist across tokens, so each channel
gets its own range over the page's T tokens; values have no such structure and are grouped
per token over the head dim (in groups of G channels, default the whole head dim).
These two codecs are also what KVmix uses per layer and Kitty uses for its values.

    ChannelRTN(b): {"codes": packed [H, T*b/8, D], "scale": f16 [H, D], "zero": f16 [H, D]}
    TokenRTN(b, G): {"codes": packed [H, T*b/8, D], "scale": f16 [H, T, D/G], "zero": f16 [H, T, D/G]}
(3-bit codes: int32 [H, ceil(T/10), D], see rtn.py.) zero is the group's min.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import PAGE_TOKENS, FieldSpecs, KVFormat, TileCodec
from .hadamard import fwht
from .layout import Layout
from .rtn import dequantize, pack, packed_shape, quantize, unpack

RTN_FIELDS = ("codes", "scale", "zero", None, None, None)  # Layout.fields of both codecs


@dataclass(frozen=True)
class ChannelRTN(TileCodec):
    """One (scale, zero) per channel over the page's tokens."""

    bits: int

    def field_specs(self, heads: int, head_dim: int, tokens: int = PAGE_TOKENS) -> FieldSpecs:
        (rows, _), dtype = packed_shape(tokens, head_dim, self.bits)
        return {
            "codes": ((heads, rows, head_dim), dtype),
            "scale": ((heads, head_dim), torch.float16),
            "zero": ((heads, head_dim), torch.float16),
        }

    def encode(self, x: Tensor) -> dict[str, Tensor]:
        codes, scale, zero = quantize(x, self.bits, dim=-2)
        return {"codes": pack(codes, self.bits), "scale": scale, "zero": zero}

    def decode(self, fields: dict[str, Tensor], tokens: int | None = None) -> Tensor:
        codes = unpack(fields["codes"], self.bits, tokens or PAGE_TOKENS)
        return dequantize(codes, fields["scale"], fields["zero"], dim=-2)

    def kernel_layout(self, heads: int, head_dim: int, tokens: int = PAGE_TOKENS) -> Layout:
        return Layout.with_channel_scales(self.bits, heads, head_dim, tokens, RTN_FIELDS)


@dataclass(frozen=True)
class TokenRTN(TileCodec):
    """One (scale, zero) per token and group of `group` channels (None: the whole head dim).
    rotated: quantize x @ Hd instead (hadamard.py; kitty-qh's values)."""

    bits: int
    group: int | None = None
    rotated: bool = False

    def n_groups(self, head_dim: int) -> int:
        group = self.group or head_dim
        if head_dim % group:
            raise ValueError(f"channel group {group} does not divide head dim {head_dim}")
        return head_dim // group

    def field_specs(self, heads: int, head_dim: int, tokens: int = PAGE_TOKENS) -> FieldSpecs:
        (rows, _), dtype = packed_shape(tokens, head_dim, self.bits)
        groups = (heads, tokens, self.n_groups(head_dim))
        return {"codes": ((heads, rows, head_dim), dtype), "scale": (groups, torch.float16), "zero": (groups, torch.float16)}

    def encode(self, x: Tensor) -> dict[str, Tensor]:
        if self.rotated:
            x = fwht(x)
        grouped = x.unflatten(-1, (self.n_groups(x.shape[-1]), -1))  # [..., H, T, D/G, G]
        codes, scale, zero = quantize(grouped, self.bits, dim=-1)
        return {"codes": pack(codes.flatten(-2), self.bits), "scale": scale, "zero": zero}

    def decode(self, fields: dict[str, Tensor], tokens: int | None = None) -> Tensor:
        scale = fields["scale"]
        codes = unpack(fields["codes"], self.bits, scale.shape[-2]).unflatten(-1, (scale.shape[-1], -1))
        return dequantize(codes, scale, fields["zero"], dim=-1).flatten(-2)

    def kernel_layout(self, heads: int, head_dim: int, tokens: int = PAGE_TOKENS) -> Layout:
        return Layout.with_token_scales(self.bits, heads, head_dim, tokens, self.n_groups(head_dim), RTN_FIELDS,
                                        rotate=self.rotated)


def kivi_format(name: str, k_bits: int, v_bits: int, v_group: int | None = None, sink: int | None = None) -> KVFormat:
    return KVFormat(name, ChannelRTN(k_bits), TokenRTN(v_bits, v_group), sink)
