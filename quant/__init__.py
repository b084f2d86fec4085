"""quant: how a page of K or V (128 tokens x head dim, all kv heads) becomes bits and back.

A torch reference that runs on CPU and GPU: the oracle the Triton kernels are checked
against and the engine's path off-GPU. It imports nothing else of ours.

    fmt = quant.get_format("kitty")          # a KVFormat: fmt.k / fmt.v are TileCodecs
    fields = fmt.k.encode(k_page)            # k_page [..., H, T, D] -> dict of packed tensors
    k_hat = fmt.k.decode(fields)             # float32 [..., H, T, D] (rotated domain if fmt.rotated)
    fmt.page_bytes(H, D), fmt.bits_per_element(H, D)

Files: base.py (TileCodec, KVFormat, fp16), rtn.py (RTN + bit packing), one file per
method (kivi, kitty, kvarn, nqkv, kvmix). Adding a method = one file + one PRESETS line.
Command lines: `python -m quant report` (__main__.py: every format on a real model's K/V),
`python -m quant.kvmix profile` (writes a KVmix plan; plans/ holds the default model's).

What kernels read: codec.kind says which reader; the codec's options (bits, per_channel,
ratio / n_boost(D), block; nqkv.block_size) and field_specs say the layout; PAGE_TOKENS,
CODES_PER_WORD3 and NF4_LEVELS are the constants.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

from .base import PAGE_TOKENS, KVFormat, TileCodec, fp16_format
from .kivi import kivi_format
from .kitty import kitty_format
from .kvarn import kvarn_format
from .nqkv import NF4_LEVELS, nqkv_format
from .rtn import CODES_PER_WORD3


def kvmix_format(name: str, **options) -> KVFormat:
    # imported on use, so that `python -m quant.kvmix profile` does not load kvmix twice
    from .kvmix import kvmix_format as make

    return make(name, **options)


# preset name -> factory(name, **options); options override the preset's defaults
PRESETS: dict[str, Callable[..., KVFormat]] = {
    "fp16": fp16_format,
    "kivi-k2v2": partial(kivi_format, k_bits=2, v_bits=2),
    "kivi-k2v2-nosink": partial(kivi_format, k_bits=2, v_bits=2),  # same pages; the cache drops the sink
    "kivi-k4v4": partial(kivi_format, k_bits=4, v_bits=4),
    "kitty": partial(kitty_format, ratio=1 / 8),
    "kitty-pro": partial(kitty_format, ratio=1 / 4),
    "kvarn": partial(kvarn_format, k_bits=2, v_bits=2),
    "kvarn-k4v2": partial(kvarn_format, k_bits=4, v_bits=2),
    "nqkv": nqkv_format,
    "kvmix": kvmix_format,
}
FORMAT_NAMES: list[str] = list(PRESETS)


def get_format(name: str, **options) -> KVFormat:
    """The format of a preset; options e.g. v_group= (kivi, kitty, kvmix V), score=/ratio= (kitty), iters= (kvarn),
    block= (nqkv), plan=/n_layers= (kvmix)."""
    if name not in PRESETS:
        raise ValueError(f"unknown KV format {name!r}; choose one of: {', '.join(FORMAT_NAMES)}")
    return PRESETS[name](name, **options)


__all__ = ["CODES_PER_WORD3", "FORMAT_NAMES", "NF4_LEVELS", "PAGE_TOKENS", "PRESETS", "KVFormat", "TileCodec", "get_format"]
