"""KIVI: keys quantized per channel, values per token, by plain RTN.

Keys have a few channels of large magnitude that persist across tokens, so each channel
gets its own range over the page's T tokens; values have no such structure and are grouped
per token over the head dim (in groups of G channels, default the whole head dim).
These two codecs are also what KVmix uses per layer and Kitty uses for its values.

    ChannelRTN(b): {"codes": packed [H, T*b/8, D], "scale": f16 [H, D], "zero": f16 [H, D]}
    TokenRTN(b, G): {"codes": packed [H, T*b/8, D], "scale": f16 [H, T, D/G], "zero": f16 [H, T, D/G]}
(3-bit codes: "codes" packed [H, T/4, D] holds their two low bits and "high" [H, T/8, D] the
third, see rtn.py.) zero is the group's min.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import PAGE_TOKENS, FieldSpecs, KVFormat, TileCodec
from .hadamard import fwht
from .layout import Layout
from .rtn import HIGH_PLANE, dequantize, pack_planes, plane_specs, quantize, unpack_planes


def rtn_fields(bits: int) -> tuple[str | None, ...]:
    """Layout.fields of both codecs (3-bit codes keep their high bit in the HIGH slot)."""
    return ("codes", "scale", "zero", None, HIGH_PLANE if bits == 3 else None, None)


@dataclass(frozen=True)
class ChannelRTN(TileCodec):
    """One (scale, zero) per channel over the page's tokens."""

    bits: int

    def field_specs(self, heads: int, head_dim: int, tokens: int = PAGE_TOKENS) -> FieldSpecs:
        planes = plane_specs(heads, tokens, head_dim, self.bits)
        return {**planes, "scale": ((heads, head_dim), torch.float16), "zero": ((heads, head_dim), torch.float16)}

    def encode(self, x: Tensor) -> dict[str, Tensor]:
        codes, scale, zero = quantize(x, self.bits, dim=-2)
        return {**pack_planes(codes, self.bits), "scale": scale, "zero": zero}

    def decode(self, fields: dict[str, Tensor]) -> Tensor:
        return dequantize(unpack_planes(fields, self.bits), fields["scale"], fields["zero"], dim=-2)

    def kernel_layout(self, heads: int, head_dim: int, tokens: int = PAGE_TOKENS) -> Layout:
        return Layout.with_channel_scales(self.bits, heads, head_dim, tokens, rtn_fields(self.bits))


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
        planes = plane_specs(heads, tokens, head_dim, self.bits)
        groups = (heads, tokens, self.n_groups(head_dim))
        return {**planes, "scale": (groups, torch.float16), "zero": (groups, torch.float16)}

    def encode(self, x: Tensor) -> dict[str, Tensor]:
        if self.rotated:
            x = fwht(x)
        grouped = x.unflatten(-1, (self.n_groups(x.shape[-1]), -1))  # [..., H, T, D/G, G]
        codes, scale, zero = quantize(grouped, self.bits, dim=-1)
        return {**pack_planes(codes.flatten(-2), self.bits), "scale": scale, "zero": zero}

    def decode(self, fields: dict[str, Tensor]) -> Tensor:
        scale = fields["scale"]
        codes = unpack_planes(fields, self.bits).unflatten(-1, (scale.shape[-1], -1))
        return dequantize(codes, scale, fields["zero"], dim=-1).flatten(-2)

    def kernel_layout(self, heads: int, head_dim: int, tokens: int = PAGE_TOKENS) -> Layout:
        return Layout.with_token_scales(self.bits, heads, head_dim, tokens, self.n_groups(head_dim), rtn_fields(self.bits),
                                        rotate=self.rotated)


def kivi_format(name: str, k_bits: int, v_bits: int, v_group: int | None = None, sink: int | None = None) -> KVFormat:
    return KVFormat(name, ChannelRTN(k_bits), TokenRTN(v_bits, v_group), sink)
