"""Uniform asymmetric round-to-nearest and the bit packing every quantized page uses.

RTN over a group of values: zero = min, scale = (max - min) / (2^b - 1),
code = clamp(round((x - zero) / scale), 0, 2^b - 1), x' = code * scale + zero.
scale and zero are stored in fp16 and the codes are computed against the *stored* values,
so decode sees exactly the grid encode rounded to. CPU and CUDA give identical codes.

Packing is along the token axis (dim -2 of a [..., T, D] tensor), "split" layout, so a
kernel can dequantize token sub-block j of a page with one shift and one mask:
- 1, 2 and 4 bits: n = 8 // bits codes per uint8; byte row i (0 <= i < T/n) holds tokens
  i, i + T/n, i + 2T/n, ...; the code of token j*(T/n) + i sits at bits [bits*j, bits*(j+1)).
- 3 bits: two planes (pack_planes), "codes" with the two low bits of every code packed as
  2-bit codes and "high" with the third packed as 1-bit codes: 3 bits a code exactly, and each
  plane unpacks like any other (in the attention kernel: the same magic OR, and the high plane
  one more product, weighted 4). One 32-bit word of ten codes packed side by side stored 3.25
  bits a code, and its slots took a shift, a mask and an int-to-float conversion per code.
"""

from __future__ import annotations

import torch
from torch import Tensor

HIGH_PLANE = "high"  # the field of a 3-bit codec that holds the codes' high bit (pack_planes)


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
    """Byte rows of a packed plane of `tokens` codes, T*bits/8 (3 bits: its low plane's, T/4)."""
    return tokens * (2 if bits == 3 else bits) // 8


def packed_shape(tokens: int, dim: int, bits: int) -> tuple[int, int]:
    """(rows, dim) of the uint8 plane that pack() makes of a [tokens, dim] plane of 1-, 2- or 4-bit codes."""
    if bits not in (1, 2, 4):
        raise ValueError(f"no packing for {bits}-bit codes (1, 2 or 4; 3-bit codes are two planes: pack_planes)")
    n = 8 // bits
    if tokens % n:
        raise ValueError(f"{tokens} tokens do not split into {n} {bits}-bit sub-blocks")
    return code_rows(bits, tokens), dim


def pack(codes: Tensor, bits: int) -> Tensor:
    """Pack codes [..., T, D] (values < 2^bits) along T in the split layout (module docstring)."""
    T = codes.shape[-2]
    packed_shape(T, codes.shape[-1], bits)  # validates bits and T
    per_byte = 8 // bits
    slots = codes.to(torch.uint8).unflatten(-2, (per_byte, T // per_byte))
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device).view(per_byte, 1, 1)
    # the shifted codes occupy disjoint bits, so their sum is their bitwise OR
    return (slots << shifts).sum(-3, dtype=torch.uint8)


def unpack(packed: Tensor, bits: int) -> Tensor:
    """Inverse of pack: uint8 codes [..., T, D], T = rows * 8 / bits."""
    packed_shape(packed.shape[-2] * 8 // bits, packed.shape[-1], bits)  # validates bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device).view(8 // bits, 1, 1)
    return ((packed.unsqueeze(-3) >> shifts) & (2**bits - 1)).flatten(-3, -2)


def plane_specs(heads: int, tokens: int, dim: int, bits: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each plane pack_planes makes of [heads, tokens, dim] `bits`-bit codes."""
    widths = {"codes": 2, HIGH_PLANE: 1} if bits == 3 else {"codes": bits}
    return {name: ((heads, *packed_shape(tokens, dim, b)), torch.uint8) for name, b in widths.items()}


def pack_planes(codes: Tensor, bits: int) -> dict[str, Tensor]:
    """codes [..., T, D] as the fields that store them: "codes", and at 3 bits also HIGH_PLANE (the
    high bit; "codes" then holds the two low bits)."""
    if bits == 3:
        return {"codes": pack(codes & 3, 2), HIGH_PLANE: pack(codes >> 2, 1)}
    return {"codes": pack(codes, bits)}


def unpack_planes(fields: dict[str, Tensor], bits: int) -> Tensor:
    """Inverse of pack_planes: uint8 codes [..., T, D] (other fields are ignored)."""
    if bits == 3:
        return unpack(fields["codes"], 2) | (unpack(fields[HIGH_PLANE], 1) << 2)
    return unpack(fields["codes"], bits)
