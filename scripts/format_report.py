"""python scripts/format_report.py [--model M]: what each format loses on a real model's keys and values.

Runs the model (default SmolLM2-135M-Instruct) over a text, records every layer's q, k, v as
the cache would receive them (after RoPE), cuts K and V into 128-token pages, and passes
them through each preset's encode and decode. Per preset it prints one row of a markdown table:

- bits/element: every byte a page stores (codes, scales, ids) x 8 / elements, K and V averaged;
- K rel. MSE, V rel. MSE: ||x' - x||^2 / ||x||^2, per layer, averaged over layers;
- attn cosine: cosine similarity between the causal attention probabilities of each query
  computed with the decoded K and with the exact K, averaged over queries, heads, layers;
- out rel. error: ||o' - o|| / ||o|| of the attention output with decoded K and V.

Every token goes through the format: the cache's FP16 sink and recent tiers are left out, so
this measures the format alone.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kernels  # noqa: E402
from loading import load_model  # noqa: E402
from quant import FORMAT_NAMES, PAGE_TOKENS, KVFormat, TileCodec, get_format  # noqa: E402
from quant.kvmix import SAMPLE_TEXT  # noqa: E402


def capture(model: torch.nn.Module, ids: Tensor) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Per layer, float32 q [Hq, L, D], k and v [H, L, D] of one sequence."""
    captured = []

    class Recorder:  # stands in for the KV cache: records, then attends exactly
        def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, rope=None) -> Tensor:
            if rope is not None:  # a cache gets q and k before the rotary embedding
                q, k = kernels.apply_rope(q, *rope), kernels.apply_rope(k, *rope)
            captured.append((q[0].float(), k[0].float(), v[0].float()))
            return kernels.causal_attention(q, k, v, model.config.sliding_window)

    with torch.no_grad():
        model(ids[None], cache=Recorder())
    return captured


def roundtrip(codec: TileCodec, x: Tensor, q: Tensor) -> Tensor:
    """x [H, L, D] (L a multiple of 128) through encode and decode, page by page; a codec that
    ranks by the queries gets the mean |q| of each page's own queries (q [Hq, L, D])."""
    pages = x.unflatten(1, (-1, PAGE_TOKENS)).transpose(0, 1)  # [pages, H, 128, D]
    if codec.needs_queries:
        H, (Hq, L, D) = x.shape[0], q.shape
        weight = q.abs().view(H, Hq // H, L // PAGE_TOKENS, PAGE_TOKENS, D).mean((1, 3)).transpose(0, 1)
        fields = codec.encode(pages, weight)
    else:
        fields = codec.encode(pages)
    return codec.unrotate(codec.decode(fields)).transpose(0, 1).flatten(1, 2)


def attention(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Causal attention probabilities [Hq, L, L] and output [Hq, L, D], GQA by repeating kv heads."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    p = scores.masked_fill(~kernels.reference.causal_mask(q.shape[1], None, q.device), -torch.inf).softmax(-1)
    return p, p @ v


def measure(fmt: KVFormat, captured: list[tuple[Tensor, Tensor, Tensor]]) -> dict[str, float]:
    rows = []
    for layer, (q, k, v) in enumerate(captured):
        f = fmt.for_layer(layer)
        k_hat, v_hat = roundtrip(f.k, k, q), roundtrip(f.v, v, q)
        p, o = attention(q, k, v)
        p_hat, o_hat = attention(q, k_hat, v_hat)
        rows.append((
            ((k_hat - k).pow(2).sum() / k.pow(2).sum()).item(),
            ((v_hat - v).pow(2).sum() / v.pow(2).sum()).item(),
            torch.cosine_similarity(p_hat, p, dim=-1).mean().item(),
            ((o_hat - o).norm() / o.norm()).item(),
        ))
    means = [sum(col) / len(rows) for col in zip(*rows)]
    heads, _, head_dim = captured[0][1].shape
    return {"bits": fmt.bits_per_element(heads, head_dim), **dict(zip(("k_mse", "v_mse", "cosine", "out_err"), means))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="scripts/format_report.py",
                                     description="bits and errors of every KV format on a model's real K/V")
    parser.add_argument("--model", default=None, help="HF folder, hub id or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--text", default=str(SAMPLE_TEXT), help="text to run (its last --tokens tokens)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens to capture, rounded down to whole pages")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    model, tokenizer = load_model(args.model, device=args.device, dtype=torch.float32)
    ids = torch.tensor(tokenizer.encode(Path(args.text).read_text()), device=args.device)
    length = min(args.tokens, len(ids)) // PAGE_TOKENS * PAGE_TOKENS
    if length == 0:
        raise SystemExit(f"{args.text} has fewer than {PAGE_TOKENS} tokens")
    captured = capture(model, ids[-length:])  # the end of the text: the kvmix profiler uses its start
    heads, _, head_dim = captured[0][1].shape
    print(f"{args.model or 'SmolLM2-135M-Instruct'}: {len(captured)} layers, {heads} kv heads, head dim {head_dim}, "
          f"{length} tokens = {length // PAGE_TOKENS} pages per layer, every token quantized\n")
    print("| format | bits/element | K rel. MSE | V rel. MSE | attn cosine | out rel. error |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in FORMAT_NAMES:
        try:
            fmt = get_format(name)
            if fmt.sink is not None:  # a preset that differs from another only in the cache's sink
                continue
            fmt.layer_formats(len(captured))  # e.g. a kvmix plan made for another model
            r = measure(fmt, captured)
        except (ValueError, FileNotFoundError) as e:  # e.g. no kvmix plan for this model
            print(f"| {name} | n/a: {e} | | | | |")
            continue
        print(f"| {name} | {r['bits']:.3f} | {r['k_mse']:.4f} | {r['v_mse']:.4f} | {r['cosine']:.4f} | {r['out_err']:.4f} |")


if __name__ == "__main__":
    main()
