"""Programmatic dependent launch (PDL): letting a decode kernel start before the one ahead of it
in the stream has finished, and the rule every such kernel follows.

At batch 1 a decode step is ~350 kernels, most of them a few microseconds long, and a GEMV only
reaches full bandwidth once all its loads are in flight. On Hopper a kernel launched with the
PDL attribute may begin while its predecessor still runs; `griddepcontrol.wait` then blocks
until the predecessor has completed and its writes are visible. So a GEMV can put its first
strip of weights in flight, and a small kernel can be resident, while the previous kernel
drains: the step loses less to launch gaps and ramps.

The rule, for every kernel launched with `launch_pdl=enabled(device)`:
- before `wait_then_release` it reads only memory no decode kernel writes, and writes nothing:
  weights (e.g. by `prefetch_weights` into L2), or the KV cache's slots, token counts, page table
  and pages, which change only between steps (so both split kernels look up their first page first);
- `wait_then_release` waits for its predecessor, then lets its own successor launch. Releasing
  only after the wait keeps at most one kernel running ahead of the one doing the work, so the
  early reads above are the only thing that overlaps;
- every program calls it, including programs that have nothing to do: a grid completes only
  after each of its programs has waited, which is what orders the kernels two apart.

Two small kernels call `release_then_wait` instead: rope_store, ahead of the attention's split
kernel, and the attention's merge, ahead of the o_proj GEMV. Their successor then launches while
they still wait, so its programs are resident and past their own pre-wait part sooner (a kernel
of a few microseconds otherwise hands over only after its predecessor has ended). The order of
the work is unchanged: the successor's wait still waits for this kernel, which completes only
after its own wait. At batch 1 / 32k this made Llama-3-8B-shaped decode 0.2-0.7% faster with
Kitty's pages and 0.1-0.4% with FP16 (docs/benchmarks.md, session 35).

Kernels that do not take part (cuBLAS, torch ops) are ordered as usual; one launched after
them waits for their completion at its wait. Under CUDA-graph capture the attribute becomes a
programmatic edge of the graph.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# NANOKV_PDL=0 launches every kernel in plain stream order (to measure what PDL gains)
ENV = "NANOKV_PDL"


@functools.lru_cache(maxsize=None)
def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` are launched with PDL: compiled (not interpreted) kernels on a
    GPU of compute capability 9.0 or newer, unless NANOKV_PDL=0."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get(ENV) == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def prefetch_weights(ptrs, PDL: tl.constexpr):
    """Ask for the 128-byte lines at ptrs (weights only) to be brought into L2, without waiting
    or holding registers: what a kernel may do before wait_then_release (no-op without PDL)."""
    if PDL:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """Wait for the previous kernel's completion, then allow the next kernel to launch (no-ops
    when PDL is off, as under the interpreter, which cannot run the PTX)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def release_then_wait(PDL: tl.constexpr):
    """Let the next kernel launch, then wait for the previous one (see the module docstring)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


def kernel_options(device: torch.device, wanted: bool = True) -> dict:
    """Keyword arguments for a launch of a kernel that takes a `PDL` constexpr: the constexpr, and
    the launch option when PDL is on (the interpreter takes no such option). wanted=False: off
    for this launch."""
    pdl = wanted and enabled(device)
    return {"PDL": pdl, "launch_pdl": True} if pdl else {"PDL": False}
