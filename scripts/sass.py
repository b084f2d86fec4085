"""Offline sm_90 compile of the attention's page loop: registers, spill and instruction counts, no GPU.

Reading the SASS before spending device time: compile `_split_kernel` as decode_attention would launch
it on an H100 (132 SMs) for a bench.py kernels cell, then count the instructions of the page loop
(the backward branch around most of _pages' code), by opcode and by source line.

    python scripts/sass.py kitty,kivi-k2v2 [--batch 16] [--ctx 32768] [--variant u4-n4] [--lines 20] [--loads]

--loads lists the loop's global loads in issue order, each run of them counted in the MMAs before it and
named by its line in _pages: ptxas may sink a load behind products it could have overlapped (a second
memory latency a page), which the source order does not show.

Needs a Triton with the NVIDIA backend (its wheel ships ptxas, cuobjdump and nvdisasm) and torch on
the CPU; the SASS, TTGIR and cubin land in /tmp/sass. Count only: session 16 found a version with
6-9% fewer instructions 9-26% slower on the GPU (shared-memory waits), so time what looks good.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
OUT = "/tmp/sass"


class _H100:
    """Just enough of a Triton driver to compile for sm_90 without a GPU."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)


def compile_split_kernel(kv: str, batch: int, ctx: int, spec: str):
    """The compiled _split_kernel of one bench.py kernels cell, and its grid."""
    from benchmarks.kernels import attention_inputs, variant
    from kernels import attention

    driver.set_active(_H100())
    seen = []

    class Capture:  # in place of `kernel[grid](...)`: compile only
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((self.fn.warmup(*args, grid=grid, **kw), grid))

    with mock.patch.multiple(attention, _sm_count=lambda device: 132, INTERPRETED=False,
                             _split_kernel=Capture(attention._split_kernel),
                             _merge_kernel=Capture(attention._merge_kernel)):
        (q, fmt, tiers, scale), _ = attention_inputs(kv, batch, ctx, device="cpu")
        attention.decode_attention(q, fmt, tiers, scale, launch=variant(spec))
    return seen[0]


def page_loop(kernel, source: list[str]) -> tuple[dict, list[tuple[int, int, str]]]:
    """Resources, and the page loop's instructions in order as (source line, the line in _pages that
    inlined it, opcode)."""
    cubin = os.path.join(OUT, "kernel.cubin")
    open(cubin, "wb").write(kernel.asm["cubin"])
    res = subprocess.run([f"{BIN}/cuobjdump", "-res-usage", cubin], capture_output=True, text=True).stdout
    resources = {k: int(re.search(rf"{k}:(\d+)", res).group(1)) for k in ("REG", "STACK")}
    text = subprocess.run([f"{BIN}/nvdisasm", "--print-line-info-inline", cubin], capture_output=True, text=True).stdout
    def_line = {name: next(i for i, line in enumerate(source) if line.startswith(f"def {name}")) + 1
                for name in ("_dense_tier", "_pages", "_page_split")}

    def in_pages(line):  # _pages and the helpers above it, not the dense tiers
        return line and line < def_line["_page_split"] and not def_line["_dense_tier"] <= line < def_line["_pages"]

    code, labels, pending = [], {}, []  # code: (address, source line, line in _pages, opcode, branch label)
    line = site = None
    chain = []  # the line numbers of an instruction's inlining chain, innermost first
    for row in text.splitlines():
        if '//## File' in row and 'attention.py' in row:
            if not chain:
                line = int(re.search(r"line (\d+)", row).group(1))
            chain += [int(n) for n in re.findall(r"line (\d+)", row)]
            site = next((n for n in chain if def_line["_pages"] <= n < def_line["_page_split"]), line)
        elif m := re.match(r"(\.L_x_\d+):", row):
            pending.append(m.group(1))
        elif m := re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", row):
            address = int(m.group(1), 16)
            labels.update((label, address) for label in pending)
            pending = []
            target = re.search(r"BRA .*?\((\.L_x_\d+)\)", row)
            code.append((address, line, site, m.group(2), target.group(1) if target else None))
            chain = []
    loops = [(sum(1 for a, ln, _, _, _ in code if labels[t] <= a <= end and in_pages(ln)), labels[t], end)
             for end, _, _, _, t in code if t is not None and labels[t] < end]
    _, lo, hi = max(loops)
    return resources, [(ln, site, op) for a, ln, site, op, _ in code if lo <= a <= hi]


def load_bursts(body: list[tuple[int, int, str]], gap: int = 8) -> list[tuple[int, int, int, int]]:
    """When the page loop asks for its global loads, counted in MMAs issued before them: runs of loads
    from one line of _pages with fewer than `gap` MMAs between them, as (first MMA count, last, loads,
    line). A run that starts after the products it could have overlapped waits a whole memory latency."""
    bursts, mmas = [], 0
    for _, ln, op in body:
        if op == "HMMA":
            mmas += 1
        elif op.startswith("LDG"):
            if bursts and bursts[-1][3] == ln and mmas - bursts[-1][1] < gap:
                bursts[-1][1:3] = [mmas, bursts[-1][2] + 1]
            else:
                bursts.append([mmas, mmas, 1, ln])
    return [tuple(b) for b in bursts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kvs", help="formats, comma-separated (bench.py kernels names)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--variant", default="auto", help="a bench.py kernels launch variant, e.g. u4-n4-r168")
    ap.add_argument("--lines", type=int, default=0, help="also the N source lines with the most instructions")
    ap.add_argument("--loads", action="store_true", help="also when the page loop asks for its global loads")
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = open(os.path.join(root, "kernels", "attention.py")).read().splitlines()
    for kv in args.kvs.split(","):
        kernel, grid = compile_split_kernel(kv, args.batch, args.ctx, args.variant)
        for ext in ("ttgir", "ptx"):
            open(os.path.join(OUT, f"{kv}.{ext}"), "w").write(kernel.asm[ext])
        res, body = page_loop(kernel, source)
        os.replace(os.path.join(OUT, "kernel.cubin"), os.path.join(OUT, f"{kv}.cubin"))
        ops, lines = collections.Counter(op for _, _, op in body), collections.Counter(ln for ln, _, _ in body)
        print(f"{kv}: grid {grid}, {res['REG']} registers, {res['STACK']} bytes of stack, page loop "
              f"{sum(ops.values())} instructions: {', '.join(f'{k} {n}' for k, n in ops.most_common(10))}")
        for ln, n in lines.most_common(args.lines):
            print(f"  {n:5d}  L{ln}: {source[ln - 1].strip()[:90] if ln else '?'}")
        if args.loads:
            print(f"  global loads, after how many of the loop's {ops['HMMA']} MMAs:")
            for first, last, n, ln in load_bursts(body):
                print(f"  {first:4d}-{last:<4d} {n:3d} LDG  L{ln}: {source[ln - 1].strip()[:80] if ln else '?'}")


if __name__ == "__main__":
    main()
