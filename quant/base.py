"""The mechanism every format shares, and the fp16 baseline format.

A TileCodec turns one page of keys or of values, x[..., H, T, D] (H kv heads, T tokens,
D head dim, any leading batch dims), into a dict of tensors of fixed shapes (its fields)
and back. A KVFormat is a named pair of codecs, one for K and one for V, plus the page-level
facts the cache needs: bytes per page, honest bits per element, the rotation applied to q and
to the attention output where a codec stores rotated pages, and the format of a given layer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor

from .hadamard import fwht
from .layout import Layout

PAGE_TOKENS = 128  # tokens per page; also the group over which K is quantized per channel

FieldSpecs = dict[str, tuple[tuple[int, ...], torch.dtype]]


class TileCodec(ABC):
    """Encodes pages of K or V. Subclasses are small frozen dataclasses of their options."""

    @abstractmethod
    def field_specs(self, heads: int, head_dim: int, tokens: int = PAGE_TOKENS) -> FieldSpecs:
        """Shape and dtype of every stored tensor of ONE page (no leading batch dims)."""

    # True for a codec that stores x @ Hd (hadamard.py): decode gives the rotated values
    rotated = False
    # True for a codec whose encode also takes query_weight [..., H, D], the mean |q| per kv-head
    # channel over recent steps, which the cache then keeps (Kitty's q-aware score)
    needs_queries = False

    @abstractmethod
    def encode(self, x: Tensor) -> dict[str, Tensor]:
        """x [..., H, T, D] -> fields, each [..., *field_shape]."""

    @abstractmethod
    def decode(self, fields: dict[str, Tensor]) -> Tensor:
        """fields -> float32 [..., H, T, D]."""

    @abstractmethod
    def kernel_layout(self, heads: int, head_dim: int, tokens: int = PAGE_TOKENS) -> Layout:
        """How the kernels address this codec's page fields (layout.py), at these sizes."""

    def unrotate(self, x: Tensor) -> Tensor:
        """What decode gave, back in the original domain."""
        return fwht(x).to(x.dtype) if self.rotated else x

    def nbytes(self, heads: int, head_dim: int, tokens: int = PAGE_TOKENS) -> int:
        """Bytes one page stores: codes, scales, ids, everything."""
        specs = self.field_specs(heads, head_dim, tokens)
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in specs.values())


@dataclass(frozen=True)
class Fp16Codec(TileCodec):
    """No quantization: the page holds x in fp16 (the baseline, same tiers as the others)."""

    def field_specs(self, heads: int, head_dim: int, tokens: int = PAGE_TOKENS) -> FieldSpecs:
        return {"x": ((heads, tokens, head_dim), torch.float16)}

    def encode(self, x: Tensor) -> dict[str, Tensor]:
        return {"x": x.half()}

    def decode(self, fields: dict[str, Tensor]) -> Tensor:
        return fields["x"].float()

    def kernel_layout(self, heads: int, head_dim: int, tokens: int = PAGE_TOKENS) -> Layout:
        return Layout.with_channel_scales(16, heads, head_dim, tokens, ("x", None, None, None, None, None))


@dataclass(frozen=True)
class StoredOrder(TileCodec):
    """`inner` with its code planes stored in another order than [H, rows, D]: the one the
    attention's unpack reads fastest (kernels/attention.py). Everything else is inner's."""

    inner: TileCodec

    def __getattr__(self, name: str):  # the inner codec's options (bits, group, ...)
        if name == "inner":  # not set yet (copying): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def rotated(self) -> bool:
        return self.inner.rotated

    @property
    def needs_queries(self) -> bool:
        return self.inner.needs_queries

    @abstractmethod
    def store(self, codes: Tensor) -> Tensor:
        """The inner codec's plane [..., rows, D] in stored order."""

    @abstractmethod
    def load(self, codes: Tensor) -> Tensor:
        """A stored plane back as [..., rows, D]."""

    @functools.cached_property
    def planes(self) -> tuple[str, ...]:
        """The names of the code planes of every channel (Layout.code_planes)."""
        return self.inner.kernel_layout(1, 128).code_planes

    def field_specs(self, heads: int, head_dim: int, tokens: int = PAGE_TOKENS) -> FieldSpecs:
        specs = dict(self.inner.field_specs(heads, head_dim, tokens))
        for name in self.planes:
            shape, dtype = specs[name]
            specs[name] = (tuple(self.store(torch.empty(shape, device="meta")).shape), dtype)
        return specs

    def encode(self, x: Tensor, *query_weight: Tensor, **options) -> dict[str, Tensor]:
        fields = self.inner.encode(x, *query_weight, **options)
        return {**fields, **{name: self.store(fields[name]) for name in self.planes}}

    def decode(self, fields: dict[str, Tensor]) -> Tensor:
        return self.inner.decode({**fields, **{name: self.load(fields[name]) for name in self.planes}})

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner})"


class ChannelMajor(StoredOrder):
    """The code planes stored transposed, [H, D, rows]: each channel's packed tokens contiguous.
    Every format's quantized values are stored so. The attention multiplies values with the
    tokens on the reduced axis, where the tensor cores' operand layout puts four consecutive
    tokens of one channel in each thread: four code rows of a channel are then one aligned
    32-bit load, where a [rows, D] plane took three byte permutes per register to transpose in
    registers."""

    def store(self, codes: Tensor) -> Tensor:
        return codes.transpose(-1, -2).contiguous()

    def load(self, codes: Tensor) -> Tensor:
        return codes.transpose(-1, -2)

    def kernel_layout(self, heads: int, head_dim: int, tokens: int = PAGE_TOKENS) -> Layout:
        return dataclasses.replace(self.inner.kernel_layout(heads, head_dim, tokens), channel_major=True)


class SwappedColumns(StoredOrder):
    """The code planes' channels stored in the order 0 2 1 3 of every four. The quantized keys
    of 2-, 3- and 4-bit RTN formats are stored so: the attention unpacks four codes with a shift
    and two lop3 that take bytes 0, 2 and then 1, 3 of a word (one instruction fewer than
    spreading bytes 0, 1 and 2, 3 with two prmt), which puts the channels back in order."""

    def store(self, codes: Tensor) -> Tensor:
        return self.load(codes).contiguous()

    def load(self, codes: Tensor) -> Tensor:  # (the order is its own inverse)
        return codes.unflatten(-1, (-1, 2, 2)).transpose(-1, -2).flatten(-3)

    def kernel_layout(self, heads: int, head_dim: int, tokens: int = PAGE_TOKENS) -> Layout:
        return dataclasses.replace(self.inner.kernel_layout(heads, head_dim, tokens), columns_swapped=True)


class KVFormat:
    """A named (K codec, V codec) pair: what one page of one layer stores. Quantized values are
    kept channel-major (ChannelMajor), 2-, 3- and 4-bit RTN keys with their channels swapped in
    fours (SwappedColumns)."""

    # Full-precision sink tokens this format keeps: None = the cache's setting; 0 for a method as
    # published without sink tokens (e.g. KIVI).
    sink: int | None = None

    def __init__(self, name: str, k: TileCodec, v: TileCodec, sink: int | None = None):
        if not isinstance(v, (Fp16Codec, ChannelMajor)):
            v = ChannelMajor(v)
        if not isinstance(k, StoredOrder):
            lay = k.kernel_layout(1, 128)
            if lay.bits in (2, 3, 4) and not lay.nf4:
                k = SwappedColumns(k)
        self.name, self.k, self.v, self.sink = name, k, v, sink

    def sink_tokens(self, default: int) -> int:
        """The sink this format keeps when the cache's setting is `default`."""
        return default if self.sink is None else self.sink

    def for_layer(self, layer: int) -> KVFormat:
        """The format of one layer; uniform formats use the same one everywhere."""
        return self

    def layer_formats(self, n_layers: int) -> list[KVFormat]:
        """The format of every layer of an n_layers model (a per-layer format checks that it
        was made for that many layers)."""
        return [self.for_layer(i) for i in range(n_layers)]

    def window_ratios(self, n_layers: int) -> list[float]:
        """Per layer, the share of the context it keeps in full precision where that is more than
        the cache's recent window (KVmix); 0 = the window alone, as uniform formats do."""
        return [0.0] * n_layers

    def page_bytes(self, heads: int, head_dim: int, tokens: int = PAGE_TOKENS) -> int:
        """Bytes of one page: K and V of `tokens` tokens of all `heads` kv heads."""
        return self.k.nbytes(heads, head_dim, tokens) + self.v.nbytes(heads, head_dim, tokens)

    def bits_per_element(self, heads: int, head_dim: int, tokens: int = PAGE_TOKENS) -> float:
        """Every stored bit of a page over its K and V elements (metadata included)."""
        return self.page_bytes(heads, head_dim, tokens) * 8 / (2 * heads * tokens * head_dim)

    @property
    def rotated(self) -> bool:
        """True where the pages' keys or values are stored rotated (the attention then maps q
        and its pages' output)."""
        return self.k.rotated or self.v.rotated

    def rotate(self, x: Tensor) -> Tensor:
        """Map q (along its last dim) into the domain the pages' keys are stored in."""
        return fwht(x).to(x.dtype) if self.k.rotated else x

    def unrotate(self, x: Tensor) -> Tensor:
        """Map an attention output over the pages (the values' domain) back to the original one."""
        return self.v.unrotate(x)

    def __repr__(self) -> str:
        return f"KVFormat({self.name!r}, k={self.k}, v={self.v})"


def fp16_format(name: str = "fp16") -> KVFormat:
    return KVFormat(name, Fp16Codec(), Fp16Codec())
