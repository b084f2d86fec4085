"""The tier rule and what it costs: where each token of a sequence lives, and how many bytes.

A sequence of `length` tokens keeps its first `sink` tokens in full precision, every token past
the sink and the recent window in whole 128-token pages, and the rest (window .. window + 127
tokens once the sink is full) in the full-precision recent tier. A layer's window is a Window:
a fixed number of tokens, or a share of the context where that is more (KVmix's recent pivotal
context), so it can grow with the sequence. The cache (cache.py) applies this rule, the
benchmarks size pools with it, and the kernel bench builds its inputs from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from quant import PAGE_TOKENS, KVFormat


class TierCounts(NamedTuple):
    """Tokens of a sequence in each tier."""

    sink: int
    pages: int  # in pages, not tokens
    recent: int


@dataclass(frozen=True, order=True)
class Window:
    """The full-precision recent window of a layer: at least `tokens` tokens, and per_mille / 1000
    of the context where that is more. Integer arithmetic, so that the host's flush decisions and
    the device's tier counts (tokens_t) always agree."""

    tokens: int
    per_mille: int = 0

    @classmethod
    def of(cls, tokens: int, ratio: float = 0.0) -> Window:
        return cls(tokens, round(ratio * 1000))

    def at(self, length: int) -> int:
        """The window of a sequence of `length` tokens."""
        return max(self.tokens, length * self.per_mille // 1000)

    def tokens_t(self, lengths: torch.Tensor) -> torch.Tensor:
        """at() of a tensor of lengths, in device ops (a CUDA graph replays it)."""
        return (lengths * self.per_mille // 1000).clamp(min=self.tokens)


def pages_for(n_tokens: int, sink: int, window: Window) -> int:
    """Pages a sequence of n_tokens holds once flushed: everything past the sink and the window,
    in whole pages. Never decreases as n_tokens grows (a window grows by less than a token per
    token), so a decode step flushes at most one page."""
    return max(0, (n_tokens - sink - window.at(n_tokens)) // PAGE_TOKENS)


def tier_counts(length: int, sink: int, window: Window) -> TierCounts:
    """Where the tokens of a flushed sequence of `length` tokens sit."""
    n_sink = min(length, sink)
    n_pages = pages_for(length, sink, window)
    return TierCounts(n_sink, n_pages, length - n_sink - n_pages * PAGE_TOKENS)


@dataclass(frozen=True)
class CacheShape:
    """The geometry a cache is sized from: the model's KV shape, one format per layer, the sink
    and each layer's recent window, the longest sequence, and the dtype of the full-precision tiers."""

    n_kv_heads: int
    head_dim: int
    formats: tuple[KVFormat, ...]  # one per layer
    sink: int
    windows: tuple[Window, ...]  # one per layer
    max_seq_len: int
    dtype: torch.dtype

    @classmethod
    def of(cls, fmt: KVFormat, n_layers: int, n_kv_heads: int, head_dim: int, sink: int, window: int,
           max_seq_len: int, dtype: torch.dtype) -> CacheShape:
        """The shape a format gives a model: its per-layer formats and windows (`window` tokens,
        or the format's share of the context where that is more), and its own sink where it has
        one (a format published without sink tokens keeps none)."""
        windows = tuple(Window.of(window, ratio) for ratio in fmt.window_ratios(n_layers))
        return cls(n_kv_heads, head_dim, tuple(fmt.layer_formats(n_layers)), fmt.sink_tokens(sink), windows,
                   max_seq_len, dtype)

    @property
    def n_layers(self) -> int:
        return len(self.formats)

    def dense_tokens(self, window: Window) -> int:
        """Tokens of a slot's full-precision buffer in a layer of this window: the sink, the most
        the window reaches, and one page."""
        return self.sink + window.at(self.max_seq_len) + PAGE_TOKENS

    def slot_bytes(self) -> int:
        """Bytes of one sequence slot's full-precision sink and recent buffers, K and V, all layers
        (each as long as its own window needs: KVmix's differ by layer)."""
        token_bytes = 2 * self.n_kv_heads * self.head_dim * self.dtype.itemsize
        return token_bytes * sum(self.dense_tokens(w) for w in self.windows)

    def page_bytes(self) -> int:
        """Bytes of one page id: its K and V pages in every layer (a page id spans all layers)."""
        return sum(f.page_bytes(self.n_kv_heads, self.head_dim) for f in self.formats)

    def pages_needed(self, n_tokens: int) -> int:
        """Pages a sequence of n_tokens occupies at most (the layer with the shortest window)."""
        return max(pages_for(n_tokens, self.sink, w) for w in set(self.windows))

    def pages_in_budget(self, budget_bytes: int, max_seqs: int) -> int:
        """Pages that fit in a budget once max_seqs slots and the scratch slot have their
        full-precision buffers."""
        dense = (max_seqs + 1) * self.slot_bytes()
        if budget_bytes < dense:
            raise ValueError(
                f"a KV budget of {budget_bytes / 2**30:.2f} GiB cannot even hold the full-precision sink and "
                f"recent tiers of {max_seqs} sequences ({dense / 2**30:.2f} GiB): raise --kv-budget-gb "
                "or lower --max-batch"
            )
        return (budget_bytes - dense) // self.page_bytes()

    def bytes_per_sequence(self, n_tokens: int) -> int:
        """What one sequence of n_tokens takes: its slot's full-precision buffers and its pages."""
        return self.slot_bytes() + self.pages_needed(n_tokens) * self.page_bytes()

    def sequences_in_budget(self, budget_bytes: int, n_tokens: int) -> int:
        """Most sequences of n_tokens that a budget holds, the scratch slot's buffers aside."""
        return max(0, (budget_bytes - self.slot_bytes()) // self.bytes_per_sequence(n_tokens))
