"""How the next token is chosen: a request's SamplingParams, and sample(), which draws every
row's token on the device (greedy, temperature, top-k, top-p, per-request seeds)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

DEFAULT_MAX_NEW_TOKENS = 128


@dataclass
class SamplingParams:
    """How one request samples; every range is checked here, so the command line, the Python API
    and a server all refuse the same bad values with the same one-line ValueError."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        checks = [
            (self.max_new_tokens >= 1, f"max_new_tokens must be at least 1, got {self.max_new_tokens}"),
            (math.isfinite(self.temperature) and self.temperature >= 0,
             f"temperature must be >= 0 (0 = greedy), got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            # top_p 0 would keep no token at all; the smallest nucleus is greedy (temperature 0)
            (0 < self.top_p <= 1, f"top_p must be in (0, 1] (1 = off; for greedy use temperature 0), got {self.top_p}"),
            (all(isinstance(s, str) and s for s in self.stop), f"stop strings must be non-empty text, got {self.stop!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


class Sampled(Protocol):
    """What sample() needs of a request: its parameters and its own generator (None: the global one)."""

    params: SamplingParams
    generator: torch.Generator | None


def sample(logits: torch.Tensor, reqs: list[Sampled], greedy: torch.Tensor | None = None) -> torch.Tensor:
    """Next token per row, on the device: greedy at temperature 0, else temperature, top-k and
    top-p sampling, drawn from each request's own generator when it has a seed. `greedy` is the
    argmax when the caller has it already (the decode graph takes it); sampled rows overwrite it."""
    out = logits.argmax(-1) if greedy is None else greedy
    for row, req in enumerate(reqs):
        p = req.params
        if p.temperature <= 0:
            continue
        x = logits[row].float() / p.temperature
        if p.top_k > 0:
            kth = torch.topk(x, min(p.top_k, x.numel())).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_x, order = torch.sort(x, descending=True)
            cum = torch.softmax(sorted_x, -1).cumsum(-1)
            drop = cum - torch.softmax(sorted_x, -1) >= p.top_p  # keep the smallest prefix reaching top_p
            x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        out[row] = torch.multinomial(torch.softmax(x, -1), 1, generator=req.generator)[0]
    return out
