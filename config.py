"""The engine's settings and their defaults, defined once.

`LLM(model, **settings)` takes these fields as keywords, and both command lines (engine.py,
bench.py) read their defaults from here, so a default such as the sink or the window is written
in one place only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import quant

if TYPE_CHECKING:
    import torch

BACKENDS = ("auto", "triton", "torch")


@dataclass
class EngineConfig:
    """What an LLM is built with: the KV cache's method and tiers, its memory, the device and the
    kernels. Every field is also a command-line flag of the same name (with dashes)."""

    kv: str = "fp16"  # a quant/ preset: fp16, kivi-k2v2, kitty, ...
    sink: int = 32  # full-precision attention-sink tokens per sequence (a format may keep none)
    window: int = 128  # full-precision recent tokens R; the recent tier holds R .. R + 127
    kv_plan: str | None = None  # KVmix per-layer plan (JSON path); None = the shipped plan
    kv_budget_gb: float | None = None  # memory for the cache; None = 80% of free GPU memory, 1 GiB on CPU
    num_pages: int | None = None  # exact page count instead of a budget (benchmarks size pools this way)
    max_batch: int = 16  # most sequences decoded at once
    prefill_chunk: int = 2048  # most prompt tokens prefilled per step, between decode steps (0 = whole prompts)
    device: str | None = None  # None = cuda if available
    dtype: str | torch.dtype | None = None  # float32 | float16 | bfloat16; None: float32 on CPU, bfloat16 on CUDA
    backend: str = "auto"  # attention/encode kernels: triton on CUDA, the torch reference elsewhere
    cuda_graphs: bool = True  # capture decode steps in CUDA graphs
    allow_pickle: bool = False  # allow pickle .bin checkpoints (torch.load with weights_only=True)
    progress: bool = True  # progress bars while loading
    tp: int = 1  # tensor-parallel ranks, one process each under torchrun (tp.py)

    def __post_init__(self):
        try:
            kv_format(self.kv, self.kv_plan)
        except ValueError as e:  # names the choices or the bad option
            raise ValueError(f"--kv {self.kv}: {e}") from None
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown kernel backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.sink < 0 or self.window < 0:
            raise ValueError(f"sink and window must be >= 0, got sink={self.sink} window={self.window}")
        if self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 (0 = whole prompts), got {self.prefill_chunk}")
        if self.tp < 1:
            raise ValueError(f"tp must be at least 1, got {self.tp}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch}")


def kv_format(kv: str, kv_plan: str | None = None) -> quant.KVFormat:
    """The format of a --kv spec; kv_plan (--kv-plan) is the plan of kvmix and ignored by the others."""
    plan = {"plan": kv_plan} if kv_plan and kv.split(":")[0] == "kvmix" else {}
    return quant.get_format(kv, **plan)
