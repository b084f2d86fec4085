"""quant: how a page of K or V (128 tokens x head dim, all kv heads) becomes bits and back.

A torch reference that runs on CPU and GPU: the oracle the Triton kernels are checked
against and the engine's path off-GPU. It imports nothing else of ours.

    fmt = quant.get_format("kitty")          # a KVFormat: fmt.k / fmt.v are TileCodecs
    fields = fmt.k.encode(k_page)            # k_page [..., H, T, D] -> dict of packed tensors
    k_hat = fmt.k.decode(fields)             # float32 [..., H, T, D] (rotated domain if fmt.rotated)
    fmt.page_bytes(H, D), fmt.bits_per_element(H, D)

Files: base.py (TileCodec, KVFormat, fp16), rtn.py (RTN + bit packing), hadamard.py (the
rotation some codecs store), layout.py (what the kernels read of a codec), one file per method
(kivi, kitty with kitty-qh, kvarn, nqkv, kvmix). Adding a
method = one file (its codecs, kernel_layout included) + one PRESETS line.
Tools that run a real model over the formats live outside quant/: scripts/format_report.py
(every format on a model's K/V) and scripts/kvmix_plan.py (writes a KVmix plan; plans/ holds
the default model's).

What kernels read: codec.kernel_layout(H, D, T), a Layout (layout.py) that says how the page's
fields are addressed and which encode stages run, so the kernels never ask which method they
serve; PAGE_TOKENS and NF4_LEVELS are the constants.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

from .base import PAGE_TOKENS, KVFormat, TileCodec, fp16_format
from .kivi import kivi_format
from .kvmix import kvmix_format
from .kitty import kitty_format
from .kvarn import kvarn_format
from .nqkv import NF4_LEVELS, nqkv_format


# preset name -> factory(name, **options); options override the preset's defaults
PRESETS: dict[str, Callable[..., KVFormat]] = {
    "fp16": fp16_format,
    "kivi-k2v2": partial(kivi_format, k_bits=2, v_bits=2),
    "kivi-k2v2-nosink": partial(kivi_format, k_bits=2, v_bits=2, sink=0),  # KIVI as published: no sink tokens
    "kivi-k4v4": partial(kivi_format, k_bits=4, v_bits=4),
    "kitty": partial(kitty_format, ratio=1 / 8),
    "kitty-pro": partial(kitty_format, ratio=1 / 4),
    # ours: Kitty keys ranked by range x |q|, Hadamard-rotated values, at kitty's bits
    "kitty-qh": partial(kitty_format, ratio=1 / 8, score="q-aware", rotate_values=True),
    "kvarn": partial(kvarn_format, k_bits=2, v_bits=2),
    "kvarn-k4v2": partial(kvarn_format, k_bits=4, v_bits=2),
    "nqkv": nqkv_format,
    "kvmix": kvmix_format,
}
FORMAT_NAMES: list[str] = list(PRESETS)


def get_format(spec: str, **options) -> KVFormat:
    """The format of a preset, spelled "name" or "name:option=value[:option=value]" (what --kv
    takes, e.g. kitty:score=range); options e.g. v_group= (kivi, kitty, kvmix V), score=/ratio=
    (kitty), iters= (kvarn), block= (nqkv), plan= (kvmix)."""
    name, *pairs = spec.split(":")
    if name not in PRESETS:
        raise ValueError(f"unknown KV format {name!r}; choose one of: {', '.join(FORMAT_NAMES)}")
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"KV format {spec!r}: write options as name:option=value, e.g. kitty:score=range")
        options.setdefault(key.replace("-", "_"), _option_value(value))
    try:
        return PRESETS[name](spec, **options)
    except TypeError as e:  # an option the preset does not take
        raise ValueError(f"KV format {spec!r}: {e}") from None


def _option_value(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


__all__ = ["FORMAT_NAMES", "NF4_LEVELS", "PAGE_TOKENS", "PRESETS", "KVFormat", "TileCodec", "get_format"]
