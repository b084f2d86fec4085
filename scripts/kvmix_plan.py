"""Write a KVmix plan for a model: score its layers by the loss gradient of their K and V
projections (quant/kvmix.py's profiler) and give the top ones more bits and a longer window.

    python scripts/kvmix_plan.py --model M --out plan.json
    python engine.py generate --kv kvmix --kv-plan plan.json --model M "..."

The plan of the default model ships in quant/plans/smollm2-135m.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from loading import load_model  # noqa: E402
from quant.kvmix import SAMPLE_TEXT, layer_importance, plan_from_importance  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="scripts/kvmix_plan.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="model name, HF folder, hub id or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--out", required=True, help="where to write the plan")
    parser.add_argument("--text", default=str(SAMPLE_TEXT), help="text the prompts are cut from")
    parser.add_argument("--prompts", type=int, default=8, help="number of prompts")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per prompt")
    parser.add_argument("--top", type=float, default=0.2, help="fraction of layers that get more bits")
    parser.add_argument("--k-high", type=int, default=4, help="key bits of the top layers")
    parser.add_argument("--v-high", type=int, default=4, help="value bits of the top layers")
    parser.add_argument("--k-low", type=int, default=3,
                        help="key bits of the other layers (3: 2-bit keys over a 128-token page cost most of the error)")
    parser.add_argument("--v-low", type=int, default=2, help="value bits of the other layers")
    parser.add_argument("--ratios", default="0.2,0.1", metavar="TOP,REST",
                        help="share of the context each layer keeps in FP16 (recent pivotal context): the top layers "
                             "by combined K+V importance, the rest (default 0.2,0.1, the paper's)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    try:
        top_ratio, rest_ratio = (float(r) for r in args.ratios.split(","))
    except ValueError:
        raise SystemExit(f"--ratios takes two numbers, TOP,REST (e.g. 0.2,0.1), got {args.ratios!r}") from None

    model, tokenizer = load_model(args.model, device=args.device, dtype=torch.float32)
    ids = torch.tensor(tokenizer.encode(Path(args.text).read_text()))
    n = min(args.prompts, len(ids) // args.tokens)
    if n == 0:
        raise SystemExit(f"{args.text} has {len(ids)} tokens, fewer than one prompt of {args.tokens}")
    prompts = [ids[i * args.tokens:(i + 1) * args.tokens] for i in range(n)]
    k_imp, v_imp = layer_importance(model, prompts)
    name = args.model or "SmolLM2-135M-Instruct (default)"
    plan = plan_from_importance(k_imp, v_imp, args.top, args.k_high, args.v_high, args.k_low, args.v_low,
                                window_ratio=(top_ratio, rest_ratio), model=name)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    plan.save(args.out)
    k_avg = sum(p.k_bits for p in plan.layers) / len(plan.layers)
    v_avg = sum(p.v_bits for p in plan.layers) / len(plan.layers)
    print(f"wrote {args.out}: {len(plan.layers)} layers, mean code bits K {k_avg:.2f} V {v_avg:.2f} "
          f"(from {n} prompts of {args.tokens} tokens)")


if __name__ == "__main__":
    main()
