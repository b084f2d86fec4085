"""Uniform asymmetric round-to-nearest and the bit packing every quantized page uses.

RTN over a group of values: zero = min, scale = (max - min) / (2^b - 1),
code = clamp(round((x - zero) / scale), 0, 2^b - 1), x' = code * scale + zero.
scale and zero are stored in fp16 and the codes are computed against the *stored* values,
so decode sees exactly the grid encode rounded to. CPU and CUDA give identical codes.

Packing is along the token axis (dim -2 of a [..., T, D] tensor), "split" layout, so a
kernel can dequantize token sub-block j of a page with one shift and one mask:
- 2 and 4 bits: n = 8 // bits codes per uint8; byte row i (0 <= i < T/n) holds tokens
  i, i + T/n, i + 2T/n, ...; the code of token j*(T/n) + i sits at bits [bits*j, bits*(j+1)).
- 3 bits: 10 codes per int32 word, W = ceil(T/10) word rows; slot j (bits 3j..3j+2) of
  word row i holds token j*W + i; slots past T are zero and bits 30-31 are unused.
"""

from __future__ import annotations

import torch
from torch import Tensor

CODES_PER_WORD3 = 10  # 3-bit codes per int32 word (30 of its 32 bits)


def f16_floor(x: Tensor) -> Tensor:
    """Largest fp16 value <= x (fp16's own conversion rounds to nearest)."""
    h = x.half()
    return torch.where(h.float() > x, torch.nextafter(h, torch.full_like(h, -torch.inf)), h)


def f16_ceil(x: Tensor) -> Tensor:
    """Smallest fp16 value >= x."""
    h = x.half()
    return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, torch.inf)), h)


def quantize(x: Tensor, bits: int | Tensor, dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """RTN of x with one (scale, zero) per group, a group being all values along `dim`.

    bits may be a tensor that broadcasts against x with `dim` kept (Kitty: 4 or 2 per channel).
    Returns uint8 codes shaped like x and fp16 scale, zero with `dim` removed.
    The min is rounded down and the scale up to fp16, so the stored grid still covers
    [min, max] and every value is within half a (stored) step of its reconstruction.
    """
    x = x.float()
    levels = torch.as_tensor(2**bits - 1, dtype=torch.float32, device=x.device)
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    zero = f16_floor(lo)
    # divisions are spelled as products with reciprocals: torch on CPU divides by a scalar that
    # way and CUDA does not, so plain `/` gives codes that differ at ties between the two
    scale = f16_ceil((hi - zero.float()) * (1 / levels))
    s = scale.float()
    inv = torch.where(s > 0, 1 / s, 0.0)  # a constant group has scale 0: all its codes are 0
    codes = torch.minimum(((x - zero.float()) * inv).round().clamp_min(0), levels).to(torch.uint8)
    return codes, scale.squeeze(dim), zero.squeeze(dim)


def dequantize(codes: Tensor, scale: Tensor, zero: Tensor, dim: int) -> Tensor:
    """Inverse of quantize: codes * scale + zero in float32 (scale, zero lack `dim`)."""
    return codes.float() * scale.float().unsqueeze(dim) + zero.float().unsqueeze(dim)


def code_rows(bits: int, tokens: int) -> int:
    """Rows of a packed plane of `tokens` codes: T*bits/8 byte rows, or ceil(T/10) 3-bit words."""
    return -(-tokens // CODES_PER_WORD3) if bits == 3 else tokens * bits // 8


def packed_shape(tokens: int, dim: int, bits: int) -> tuple[tuple[int, int], torch.dtype]:
    """(rows, dim) and dtype that pack() makes of a [tokens, dim] code plane."""
    if bits == 3:
        return (code_rows(bits, tokens), dim), torch.int32
    if bits not in (2, 4):
        raise ValueError(f"no packing for {bits}-bit codes (2, 3 or 4)")
    n = 8 // bits
    if tokens % n:
        raise ValueError(f"{tokens} tokens do not split into {n} {bits}-bit sub-blocks")
    return (code_rows(bits, tokens), dim), torch.uint8


def pack(codes: Tensor, bits: int) -> Tensor:
    """Pack codes [..., T, D] (values < 2^bits) along T in the split layout (module docstring)."""
    T = codes.shape[-2]
    if bits == 3:
        words = -(-T // CODES_PER_WORD3)
        pad = codes.new_zeros(*codes.shape[:-2], words * CODES_PER_WORD3 - T, codes.shape[-1])
        slots = torch.cat((codes, pad), -2).to(torch.int32).unflatten(-2, (CODES_PER_WORD3, words))
        dtype, per_unit = torch.int32, CODES_PER_WORD3
    else:
        packed_shape(T, codes.shape[-1], bits)  # validates bits and T
        per_unit = 8 // bits
        slots = codes.to(torch.uint8).unflatten(-2, (per_unit, T // per_unit))
        dtype = torch.uint8
    shifts = torch.arange(0, bits * per_unit, bits, dtype=dtype, device=codes.device).view(per_unit, 1, 1)
    # the shifted codes occupy disjoint bits, so their sum is their bitwise OR
    return (slots << shifts).sum(-3, dtype=dtype)


def unpack(packed: Tensor, bits: int, tokens: int | None = None) -> Tensor:
    """Inverse of pack: uint8 codes [..., T, D].

    tokens is needed only for 3 bits, where ceil(T/10) word rows do not determine T;
    for 2 and 4 bits T = rows * 8 / bits.
    """
    if bits == 3:
        per_unit, dtype = CODES_PER_WORD3, torch.int32
        if tokens is None or -(-tokens // per_unit) != packed.shape[-2]:
            raise ValueError(f"3-bit unpack of {packed.shape[-2]} word rows needs the token count, got {tokens}")
    elif bits in (2, 4):
        per_unit, dtype = 8 // bits, torch.uint8
    else:
        raise ValueError(f"no packing for {bits}-bit codes (2, 3 or 4)")
    shifts = torch.arange(0, bits * per_unit, bits, dtype=dtype, device=packed.device).view(per_unit, 1, 1)
    codes = ((packed.unsqueeze(-3) >> shifts) & (2**bits - 1)).flatten(-3, -2)
    return codes[..., :tokens, :].to(torch.uint8) if bits == 3 else codes
