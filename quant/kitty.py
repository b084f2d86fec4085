"""Kitty: KIVI's per-channel keys at 2 bits, with the most important channels boosted to 4.

Per page and kv head every key channel gets a score and the top nb = round(ratio * D)
channels are quantized with 4 bits, the rest with 2, each with its own RTN range. Scores:

    magnitude  mean |K| over the page's tokens (the paper's; the default)
    range      max - min over the page's tokens: what a channel's RTN error scales with
    q-aware    range x the mean |q| of the channel over recent decode steps (the cache keeps
               it per sequence, layer and kv head): what the error of q.k scales with; given
               no queries, range alone
    random     a baseline

The ablation on two models is in the README; random has no Triton encode. The 4-bit
codes are stored dense-sparse, so the kernel reads the common 2-bit plane for every channel
and adds the high bits only where they exist:

    {"low":  u8 [H, T/4, D]   low 2 bits of every channel's code (2-bit packing),
     "high": u8 [H, T/4, nb]  high 2 bits of the boosted channels, in rank order,
     "ids":  int16 [H, nb]    the boosted channel ids, in rank order (best first),
     "scale", "zero": f16 [H, D]  per channel; 4-bit range for boosted channels, 2-bit otherwise}

Values are KIVI's 2-bit per-token codec. Presets: kitty (ratio 1/8), kitty-pro (1/4).

kitty-qh (ours, not in the papers): Kitty's keys ranked by the q-aware score, with values stored
rotated, v @ Hd (hadamard.py), then the same 2-bit per-token RTN: the page bytes of kitty, to
the bit (the mean |q| it ranks with is per-sequence state, not page bytes). Two changes, each
measured alone in the README's ablation:
- q-aware ranking: what q.k's error depends on is a channel's RTN step times how much the
  queries weigh that channel, so boosting by range x mean |q| spends the 4-bit planes where
  the logits feel them (mean |K| ignores the queries).
- rotated values: with Kitty's keys most of the error left is in the values (SmolLM2-135M,
  every token quantized: V rel. MSE 0.26 against K's 0.064, scripts/format_report.py). A value
  row's range is set by its few largest channels; the rotation spreads them over the row first,
  as KVarN does, and takes V's error to 0.20 for free. Keys stay un-rotated: after RoPE their
  outliers sit in fixed channels, which is what per-channel ranges and boosted channels use
  (rotated 2-bit keys come out worse than KIVI's). The attention maps the pages' output back
  with Hd in its merge; q is untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import PAGE_TOKENS, FieldSpecs, KVFormat, TileCodec
from .kivi import TokenRTN
from .layout import Layout
from .rtn import dequantize, pack, packed_shape, quantize, unpack

SCORES = ("magnitude", "range", "q-aware", "random")
KERNEL_SCORES = SCORES[:3]  # the encode kernel's channel_score is the index here; it draws no random numbers


@dataclass(frozen=True)
class KittyKeyCodec(TileCodec):
    ratio: float
    score: str = "magnitude"

    def __post_init__(self):
        if self.score not in SCORES:
            raise ValueError(f"unknown Kitty channel score {self.score!r}; one of {SCORES}")

    def n_boost(self, head_dim: int) -> int:
        return round(self.ratio * head_dim)

    @property
    def needs_queries(self) -> bool:
        return self.score == "q-aware"

    def channel_scores(self, x: Tensor, query_weight: Tensor | None = None) -> Tensor:
        """[..., H, T, D] -> [..., H, D]: higher means more worth 4 bits. query_weight
        [..., H, D]: mean |q| per channel (q-aware only)."""
        if self.score == "magnitude":
            return x.abs().mean(-2)
        if self.score == "random":
            return torch.rand(x.shape[:-2] + x.shape[-1:], device=x.device)
        spread = x.amax(-2) - x.amin(-2)
        if self.score == "range":
            return spread
        # without queries (a tool that encodes pages alone) every channel weighs the same: range
        return spread if query_weight is None else spread * query_weight

    def field_specs(self, heads: int, head_dim: int, tokens: int = PAGE_TOKENS) -> FieldSpecs:
        nb = self.n_boost(head_dim)
        rows, _ = packed_shape(tokens, head_dim, 2)
        return {
            "low": ((heads, rows, head_dim), torch.uint8),
            "high": ((heads, rows, nb), torch.uint8),
            "ids": ((heads, nb), torch.int16),
            "scale": ((heads, head_dim), torch.float16),
            "zero": ((heads, head_dim), torch.float16),
        }

    def encode(self, x: Tensor, query_weight: Tensor | None = None) -> dict[str, Tensor]:
        x = x.float()
        # rank order, ties to the lower channel id (as the encode kernel breaks them)
        scores = self.channel_scores(x, query_weight)
        ids = scores.sort(dim=-1, descending=True, stable=True).indices[..., : self.n_boost(x.shape[-1])]
        boosted = torch.zeros(x.shape[:-2] + x.shape[-1:], dtype=torch.bool, device=x.device).scatter(-1, ids, True)
        bits = torch.where(boosted, 4, 2).unsqueeze(-2)
        codes, scale, zero = quantize(x, bits, dim=-2)
        high = (codes >> 2).gather(-1, ids.unsqueeze(-2).expand(*codes.shape[:-1], ids.shape[-1]))
        return {"low": pack(codes & 3, 2), "high": pack(high, 2), "ids": ids.to(torch.int16), "scale": scale, "zero": zero}

    def decode(self, fields: dict[str, Tensor]) -> Tensor:
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


def kitty_format(name: str, ratio: float, score: str = "magnitude", v_group: int | None = None,
                 rotate_values: bool = False) -> KVFormat:
    return KVFormat(name, KittyKeyCodec(ratio, score), TokenRTN(2, v_group, rotated=rotate_values))
