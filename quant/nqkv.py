"""NQKV: 4-bit NormalFloat (NF4) codes, per-token absmax blocks.

NF4 (QLoRA, Dettmers et al. 2023) has 16 levels at quantiles of N(0, 1), normalized to
[-1, 1], with an exact 0: 8 levels from the quantiles at probabilities evenly spaced from
p = 0.9677 down to 0.5 (excluded) for the positive side, 7 likewise for the negative side,
plus 0; p = (1 - 1/(2*15) + 1 - 1/(2*16)) / 2 is QLoRA's choice to keep +-1 finite. We compute
them with the normal quantile function; tests check them against QLoRA's published table.

A token's K (or V) of all kv heads, flattened to [H*D], is cut into blocks of B consecutive
elements (default 256); scale = the block's absmax; code = the index of the nearest level
to x / scale; x' = level[code] * scale.

Block rule: B is the largest divisor of H*D that is <= the requested block and is a multiple
or a divisor of D. A block therefore never covers part of two heads, so a kernel working on
one head reads whole blocks (D = 64 or 128 with B = 256 gives exactly B = 256 whenever H*D
is a multiple of 256).

    {"codes": u8 [H, T/2, D] (4-bit packing of level indices), "scale": f16 [T, H*D/B]}
Same codec for K and V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import PAGE_TOKENS, FieldSpecs, KVFormat, TileCodec
from .layout import Layout
from .rtn import code_rows, pack, packed_shape, unpack


def nf4_levels() -> Tensor:
    """The 16 NF4 levels, ascending, float32."""
    p = (1 - 1 / (2 * 15) + 1 - 1 / (2 * 16)) / 2
    pos = torch.special.ndtri(torch.linspace(p, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -torch.special.ndtri(torch.linspace(p, 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.cat((neg, torch.zeros(1, dtype=torch.float64), pos)).sort().values
    return (levels / levels.max()).float()


NF4_LEVELS = nf4_levels()


def block_size(heads: int, head_dim: int, block: int) -> int:
    """The block rule of the module docstring."""
    width = heads * head_dim
    for b in range(min(block, width), 0, -1):
        if width % b == 0 and (b % head_dim == 0 or head_dim % b == 0):
            return b
    raise AssertionError("unreachable: 1 divides everything")


@dataclass(frozen=True)
class NF4Codec(TileCodec):
    block: int = 256

    def field_specs(self, heads: int, head_dim: int, tokens: int = PAGE_TOKENS) -> FieldSpecs:
        rows, _ = packed_shape(tokens, head_dim, 4)
        blocks = heads * head_dim // block_size(heads, head_dim, self.block)
        return {"codes": ((heads, rows, head_dim), torch.uint8), "scale": ((tokens, blocks), torch.float16)}

    def encode(self, x: Tensor) -> dict[str, Tensor]:
        heads, head_dim = x.shape[-3], x.shape[-1]
        b = block_size(heads, head_dim, self.block)
        flat = x.float().transpose(-3, -2).flatten(-2).unflatten(-1, (-1, b))  # [..., T, H*D/B, B]
        scale = flat.abs().amax(-1).half()
        s = scale.float().unsqueeze(-1)
        y = flat / torch.where(s > 0, s, 1.0)  # an all-zero block stays zero
        levels = NF4_LEVELS.to(x.device)
        codes = torch.bucketize(y, (levels[1:] + levels[:-1]) / 2).to(torch.uint8)  # nearest level
        codes = codes.flatten(-2).unflatten(-1, (heads, head_dim)).transpose(-3, -2)  # back to [..., H, T, D]
        return {"codes": pack(codes, 4), "scale": scale}

    def decode(self, fields: dict[str, Tensor]) -> Tensor:
        codes, scale = unpack(fields["codes"], 4), fields["scale"]
        heads, head_dim = codes.shape[-3], codes.shape[-1]
        values = NF4_LEVELS.to(codes.device)[codes.long()].transpose(-3, -2).flatten(-2)  # [..., T, H*D]
        values = values.unflatten(-1, (scale.shape[-1], -1)) * scale.float().unsqueeze(-1)
        return values.flatten(-2).unflatten(-1, (heads, head_dim)).transpose(-3, -2)

    def kernel_layout(self, heads: int, head_dim: int, tokens: int = PAGE_TOKENS) -> Layout:
        b = block_size(heads, head_dim, self.block)
        blocks = heads * head_dim // b
        # scale is [T, H*D/B]: head h's channels start at column h*D/B (B <= D) or share column h // (B/D)
        hdiv, s_head, group = (b // head_dim, 1, head_dim) if b >= head_dim else (1, head_dim // b, b)
        return Layout(4, code_rows(4, tokens), True, tokens * blocks, s_head, blocks, hdiv, group,
                      ("codes", "scale", None, None, None, None), has_zero=False, nf4=True)


def nqkv_format(name: str, block: int = 256) -> KVFormat:
    return KVFormat(name, NF4Codec(block), NF4Codec(block))
