"""Kitty: KIVI's per-channel keys at 2 bits, with the most important channels boosted to 4.

Per page and kv head every key channel gets a score (default: mean |K| over the page's
tokens; "variance" and "random" exist for ablations) and the top nb = round(ratio * D)
channels are quantized with 4 bits, the rest with 2, each with its own RTN range. The 4-bit
codes are stored dense-sparse, so the kernel reads the common 2-bit plane for every channel
and adds the high bits only where they exist:

    {"low":  u8 [H, T/4, D]   low 2 bits of every channel's code (2-bit packing),
     "high": u8 [H, T/4, nb]  high 2 bits of the boosted channels, in rank order,
     "ids":  int16 [H, nb]    the boosted channel ids, in rank order (best first),
     "scale", "zero": f16 [H, D]  per channel; 4-bit range for boosted channels, 2-bit otherwise}

Values are KIVI's 2-bit per-token codec. Presets: kitty (ratio 1/8), kitty-pro (1/4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import PAGE_TOKENS, FieldSpecs, KVFormat, TileCodec
from .kivi import TokenRTN
from .layout import Layout
from .rtn import dequantize, pack, packed_shape, quantize, unpack

SCORES = ("magnitude", "variance", "random")
KERNEL_SCORES = SCORES[:2]  # the encode kernel's channel_score is the index here; it draws no random numbers


@dataclass(frozen=True)
class KittyKeyCodec(TileCodec):
    ratio: float
    score: str = "magnitude"

    def __post_init__(self):
        if self.score not in SCORES:
            raise ValueError(f"unknown Kitty channel score {self.score!r}; one of {SCORES}")

    def n_boost(self, head_dim: int) -> int:
        return round(self.ratio * head_dim)

    def channel_scores(self, x: Tensor) -> Tensor:
        """[..., H, T, D] -> [..., H, D]: higher means more worth 4 bits."""
        if self.score == "magnitude":
            return x.abs().mean(-2)
        if self.score == "variance":
            return x.var(-2)
        return torch.rand(x.shape[:-2] + x.shape[-1:], device=x.device)

    def field_specs(self, heads: int, head_dim: int, tokens: int = PAGE_TOKENS) -> FieldSpecs:
        nb = self.n_boost(head_dim)
        (rows, _), _ = packed_shape(tokens, head_dim, 2)
        return {
            "low": ((heads, rows, head_dim), torch.uint8),
            "high": ((heads, rows, nb), torch.uint8),
            "ids": ((heads, nb), torch.int16),
            "scale": ((heads, head_dim), torch.float16),
            "zero": ((heads, head_dim), torch.float16),
        }

    def encode(self, x: Tensor) -> dict[str, Tensor]:
        x = x.float()
        ids = self.channel_scores(x).topk(self.n_boost(x.shape[-1]), dim=-1).indices  # sorted: rank order
        boosted = torch.zeros(x.shape[:-2] + x.shape[-1:], dtype=torch.bool, device=x.device).scatter(-1, ids, True)
        bits = torch.where(boosted, 4, 2).unsqueeze(-2)
        codes, scale, zero = quantize(x, bits, dim=-2)
        high = (codes >> 2).gather(-1, ids.unsqueeze(-2).expand(*codes.shape[:-1], ids.shape[-1]))
        return {"low": pack(codes & 3, 2), "high": pack(high, 2), "ids": ids.to(torch.int16), "scale": scale, "zero": zero}

    def decode(self, fields: dict[str, Tensor], tokens: int | None = None) -> Tensor:
        codes, high = unpack(fields["low"], 2), unpack(fields["high"], 2)
        index = fields["ids"].long().unsqueeze(-2).expand_as(high)
        codes = codes.scatter(-1, index, codes.gather(-1, index) | (high << 2))
        return dequantize(codes, fields["scale"], fields["zero"], dim=-2)

    def kernel_layout(self, heads: int, head_dim: int, tokens: int = PAGE_TOKENS) -> Layout:
        encodable = self.score in KERNEL_SCORES
        refusal = f"Kitty score {self.score!r} has no Triton encode ({', '.join(KERNEL_SCORES)})"
        return Layout.with_channel_scales(2, heads, head_dim, tokens, ("low", "scale", "zero", None, "high", "ids"),
                                          n_high=self.n_boost(head_dim),
                                          channel_score=KERNEL_SCORES.index(self.score) if encodable else 0,
                                          encode_unsupported="" if encodable else refusal)


def kitty_format(name: str, ratio: float, score: str = "magnitude", v_group: int | None = None) -> KVFormat:
    return KVFormat(name, KittyKeyCodec(ratio, score), TokenRTN(2, v_group))
