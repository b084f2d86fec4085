"""Where K and V live: three tiers per sequence and layer, in memory allocated once.

    sink    the first `sink` tokens, full precision (attention sinks)
    pages   every older token, 128 per page, in the chosen quant/ format
    recent  the newest `window` .. `window`+127 tokens, full precision

Tokens enter at the end. When the recent tier reaches window + 128 tokens its oldest 128 are
encoded into one page (once every 128 decode steps; a window that is a share of the context,
KVmix's, grows meanwhile, so its layers flush less often), so a page never changes after it is
written. The sink and the recent tier of a sequence are two views of one dense buffer per
layer, [slots, kv_heads, sink + the most its window reaches + 128, head_dim]; the layers that
share a window share one allocation, as do the pages of the layers that share a codec, so that
a flush is a few launches, not a few per layer. Pages come from a pool sized from a memory
budget with the format's real bytes per page; page j of a sequence holds its tokens
sink + 128 j .. sink + 128 j + 127 in every layer, so one page table serves all layers, even
when layers keep windows of different lengths (KVmix).

The model calls `attend(layer, q, k, v, rope)` once per layer with q and k not yet rotated, so
that at a decode step the rotation and the store of the new K and V are one kernel; the engine
brackets a forward with `begin_step(slots, n_new)` and `end_step()`, and manages sequences with
`admit` / `release`. The cache is method-agnostic: the format (quant/) says what a layer's pages store, its sink and
its windows; kernels/ encodes pages and attends over them; tiers.py holds the tier rule.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

import torch

import kernels
from kvcache.pool import PagePool
from kvcache.tiers import CacheShape, Window, pages_for, tier_counts
from quant import PAGE_TOKENS, KVFormat

# The narrowest page table a decode step's attention is given (decode_table_pages). Widths are
# 2^k - 1, not 2^k: the split rule gives a 32-page table 3 splits at batch 32 against 4 for 31
# pages, and rows of 30 pages were faster in 4 (kitty at batch 32 / 4000 tokens, H100: 55.1 us
# a layer against 60.2; session 46).
MIN_TABLE_PAGES = 31


class KVCache:
    def __init__(
        self,
        fmt: KVFormat,
        *,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        sink: int,
        window: int,
        max_seqs: int,
        max_seq_len: int,
        budget_bytes: int | None = None,
        num_pages: int | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        sliding_window: int | None = None,
        backend: str | None = None,
    ):
        """A cache for max_seqs sequences of up to max_seq_len tokens, in `fmt`. Its pages fill
        budget_bytes (what the full-precision tiers leave of it), or number exactly num_pages.
        sink / window: the full-precision tiers (a format may keep its own sink). backend:
        kernels' backend (None: Triton on CUDA, the torch reference elsewhere)."""
        self.fmt = fmt
        self.shape = CacheShape.of(fmt, n_layers, n_kv_heads, head_dim, sink, window, max_seq_len, dtype)
        self.formats, self.windows, self.sink = self.shape.formats, self.shape.windows, self.shape.sink
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.max_seqs, self.max_seq_len = max_seqs, max_seq_len
        self.sliding_window = sliding_window
        self.device, self.dtype = torch.device(device), dtype
        self.backend = backend
        if kernels.pick_backend(self.device, backend) == "triton":  # refuse now, not at the first page
            for codec in {c for f in self.formats for c in (f.k, f.v)}:
                if reason := codec.kernel_layout(n_kv_heads, head_dim).encode_unsupported:
                    raise ValueError(f"{reason}: run it with --backend torch")
        if num_pages is None:
            num_pages = self.shape.pages_in_budget(budget_bytes, max_seqs)
        self.pool = PagePool(num_pages)

        # Row max_seqs of the dense buffers and the page table is a scratch slot: padding rows
        # of a CUDA-graph batch bucket write there, never into a live sequence.
        self.scratch_slot = max_seqs
        # K and V of the layers of one window in one buffer [2, layers, slots + 1, kv_heads, tokens,
        # head_dim], so that a flush moves their recent tiers in one copy; dense_k/v[layer] are its
        # views. A buffer is as long as its own window gets: KVmix's windows are 10% of the context
        # in most layers and 20% in a few, and one length for all cost Llama-3.1-8B (131072
        # positions) 3.2 GiB a slot where the layers' own lengths take 1.9.
        self._window_layers = {w: [layer for layer in range(n_layers) if self.windows[layer] == w]
                               for w in sorted(set(self.windows))}
        self._dense = {w: torch.zeros((2, len(layers), max_seqs + 1, n_kv_heads, self.shape.dense_tokens(w), head_dim),
                                      dtype=dtype, device=self.device) for w, layers in self._window_layers.items()}
        in_window = {layer: i for layers in self._window_layers.values() for i, layer in enumerate(layers)}
        self.dense_k = [self._dense[w][0, in_window[layer]] for layer, w in enumerate(self.windows)]
        self.dense_v = [self._dense[w][1, in_window[layer]] for layer, w in enumerate(self.windows)]
        # Pages of the layers that share a codec live in one buffer per field, [layers, pages, ...],
        # so that a flush encodes those layers' tiles in one launch; k/v_pages[layer] are its views.
        self.k_pages, k_groups = _alloc_layer_fields([f.k for f in self.formats], num_pages, n_kv_heads, head_dim,
                                                     self.device)
        self.v_pages, v_groups = _alloc_layer_fields([f.v for f in self.formats], num_pages, n_kv_heads, head_dim,
                                                     self.device)
        # Kitty's q-aware score ranks key channels by |q| as well: per layer, a running mean |q|
        # per slot and kv-head channel (only for formats that ask for it)
        self._query_weights = (torch.zeros(n_layers, max_seqs + 1, n_kv_heads, head_dim, device=self.device)
                               if any(f.k.needs_queries for f in self.formats) else None)
        self.max_pages_per_seq = self.pages_needed(max_seq_len)
        self.page_table = torch.zeros(max_seqs + 1, max(1, self.max_pages_per_seq), dtype=torch.int32, device=self.device)
        # Per-step inputs of the attention live in fixed buffers, so that a captured CUDA graph
        # replays a decode step once prepare_step has refreshed them.
        self._window_row = {w: i for i, w in enumerate(self._window_layers)}
        self._flush_groups = {w: _flush_groups(layers, {0: k_groups, 1: v_groups}, self.device)
                              for w, layers in self._window_layers.items()}
        self._recent_views: dict[int, tuple[int, ...]] = {}  # recent_view_tokens' answers by table width
        self._step_slots = torch.zeros(max_seqs, dtype=torch.long, device=self.device)
        self._step_counts = torch.zeros(len(self._window_row), len(StepCounts._fields), max_seqs, dtype=torch.int32,
                                        device=self.device)

        # Tokens stored per slot, kept twice: on the host for scheduling and flush decisions, on
        # the device for the attention's tier counts, so neither side waits for the other.
        self._lengths = [0] * max_seqs
        self._seq_lens = torch.zeros(max_seqs + 1, dtype=torch.long, device=self.device)
        self._uploaded_slots: list[int] = []
        self._reserved = [0] * max_seqs  # tokens each slot was admitted for
        self._pages: list[list[int] | None] = [None] * max_seqs  # reserved page ids per slot; None = free slot
        self._step: _Step | None = None

    # ---- sequences -------------------------------------------------------------------------

    def pages_needed(self, n_tokens: int) -> int:
        """Pages a sequence of n_tokens occupies at most (the layer with the shortest window)."""
        return self.shape.pages_needed(n_tokens)

    def can_ever_fit(self, n_tokens: int) -> bool:
        return self.pages_needed(n_tokens) <= self.pool.num_pages

    def admit(self, max_tokens: int) -> int | None:
        """A free slot with pages reserved for max_tokens tokens, or None if either is lacking now."""
        if max_tokens > self.max_seq_len:
            raise ValueError(f"{max_tokens} tokens exceed the cache's max_seq_len {self.max_seq_len}")
        slot = next((s for s, p in enumerate(self._pages) if p is None), None)
        if slot is None:
            return None
        pages = self.pool.allocate(self.pages_needed(max_tokens))
        if pages is None:
            return None
        self._pages[slot] = pages
        self._reserved[slot] = max_tokens
        if pages:
            self.page_table[slot, : len(pages)] = to_device(pages, self.device).int()
        self._set_length(slot, 0)
        return slot

    def release(self, slot: int) -> None:
        """Give a finished sequence's pages back to the pool and free its slot."""
        self.pool.release(self._pages[slot])
        self._pages[slot] = None
        self._lengths[slot] = 0

    def assume_stored(self, slot: int, n_tokens: int) -> None:
        """Take an admitted slot to hold n_tokens tokens already, whatever its tiers contain: a
        benchmark's stand-in for prefilling a long context (see randomize)."""
        if n_tokens > self._reserved[slot]:
            raise ValueError(f"slot {slot} was admitted for {self._reserved[slot]} tokens, not {n_tokens}")
        self._set_length(slot, n_tokens)

    def randomize(self) -> None:
        """Fill every tier of every slot with random values that decode to finite numbers: with
        assume_stored, sequences that hold a long context without a prefill."""
        with torch.no_grad():
            for layer in range(self.n_layers):
                self.dense_k[layer].normal_()
                self.dense_v[layer].normal_()
                for pages in (self.k_pages[layer], self.v_pages[layer]):
                    for name, t in pages.items():
                        _fill_random(t, name)

    def stored_tokens(self, slot: int) -> int:
        """Tokens a slot's sequence holds."""
        return self._lengths[slot]

    def _set_length(self, slot: int, n_tokens: int) -> None:
        self._lengths[slot] = n_tokens
        self._seq_lens[slot] = n_tokens

    @property
    def num_free_slots(self) -> int:
        return sum(p is None for p in self._pages)

    # ---- one forward -----------------------------------------------------------------------

    def begin_step(self, slots: list[int], n_new: int) -> torch.Tensor:
        """The next forward feeds n_new tokens to each of these slots (1 = a decode step).
        Returns the new tokens' positions [len(slots), n_new] on the device."""
        self.prepare_step(slots, n_new)
        return self.step_positions()

    def prepare_step(self, slots: list[int], n_new: int, rows: int | None = None,
                     table_pages: int | None = None) -> None:
        """The host half of begin_step, for a forward that runs step_positions itself (inside a
        CUDA graph): checks the reservations and uploads the slots, only when they changed.
        rows > len(slots) pads the batch with the scratch slot (a graph's batch bucket).
        table_pages: the page-table columns a decode step's attention sees (default
        decode_table_pages(slots)); a graph capture passes the width of the rows it will replay,
        since it runs on scratch rows."""
        for s in slots:
            if self._lengths[s] + n_new > self._reserved[s]:
                raise ValueError(f"slot {s} was admitted for {self._reserved[s]} tokens; "
                                 f"{self._lengths[s] + n_new} would overflow its reserved pages")
        rows = rows or len(slots)
        padded = slots + [self.scratch_slot] * (rows - len(slots))
        if padded != self._uploaded_slots:
            self._step_slots[:rows].copy_(to_device(padded, self.device), non_blocking=True)
            self._uploaded_slots = padded
        self._step = _Step(slots, n_new, self._step_slots[:rows], self._step_counts[:, :, :rows],
                           table_pages or self.decode_table_pages(slots))

    def decode_table_pages(self, slots: list[int]) -> int:
        """How many columns of the page table a decode step of these slots gives the attention:
        the least 2^k - 1 (MIN_TABLE_PAGES or more) that holds the slots' longest row, capped at
        the table.

        The attention sizes its launch (split count, pipelining) by the table's width, and a CUDA
        graph keeps the launch it captured, so each width is a graph of its own; these few widths
        bound the captures (six at most a batch bucket for 128k positions). Sized for the whole
        1022-page table of a 131072-position model, a launch cut 4000-token rows into one-page
        splits in several waves: kitty's attention at batch 32 took 71.5 us a layer in the engine
        against 57.5 sized for the rows (Llama-3.1-8B shape, H100; docs/benchmarks.md, session 46)."""
        longest = self.pages_needed(max((self._lengths[s] for s in slots), default=0))  # pages never shrink
        width = MIN_TABLE_PAGES
        while width < longest:
            width = 2 * width + 1
        return min(width, self.page_table.shape[1])

    def recent_view_tokens(self, table_pages: int) -> tuple[int, ...]:
        """Per layer, the most tokens its recent tier holds in a step whose rows' pages fit in
        table_pages columns: the window of the longest such row, plus up to 127 tokens not yet
        flushed and the step's own token (_step_counts). The attention sees the recent tier that
        long and splits a long one over more programs (attention.RECENT_PART_TOKENS). With a fixed
        window this is window + 128 at every width; KVmix's windows grow with the row."""
        if table_pages not in self._recent_views:
            # the longest row whose pages fit (pages never shrink as a row grows)
            longest = bisect.bisect_right(range(self.max_seq_len + 1), table_pages, key=self.pages_needed) - 1
            # (longest <= max_seq_len, so this fits each layer's dense buffer: CacheShape.dense_tokens)
            self._recent_views[table_pages] = tuple(w.at(longest) + PAGE_TOKENS for w in self.windows)
        return self._recent_views[table_pages]

    def step_positions(self) -> torch.Tensor:
        """The device half of beginning a step, in GPU ops only so that a CUDA graph can replay
        it: each row's stored length gives the tier counts its attention sees, then advances by
        the step's tokens (scratch rows stay empty). Returns the new tokens' positions [rows, n_new]."""
        step = self._step
        lengths = self._seq_lens[step.slots_t]
        for window, i in self._window_row.items():
            step.counts[i] = _step_counts(lengths, self.sink, window, step.n_new)
        live = step.slots_t != self.scratch_slot
        self._seq_lens[step.slots_t] = lengths + live * step.n_new
        return lengths[:, None] + torch.arange(step.n_new, device=self.device)

    @property
    def step_slots(self) -> torch.Tensor:
        """The device slots of the current step's rows (scratch-padded)."""
        return self._step.slots_t

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Attention of q [B, Hq, T, D] over everything stored for these rows plus the new k, v
        [B, H, T, D] (causal among the T new tokens). q and k come before the rotary embedding:
        rope = (cos, sin) [B, 1, T, D] of the new positions, or None for none. Stores k and v for
        end_step."""
        step = self._step
        scale = q.shape[-1] ** -0.5
        counts = StepCounts(*step.counts[self._window_row[self.windows[layer]]])
        if step.n_new == 1:
            # The kernels read the new token from the recent tier, so it is written first, rotated.
            cos, sin = (None, None) if rope is None else (rope[0][:, 0, 0], rope[1][:, 0, 0])
            q = kernels.rope_store(q[:, :, 0], k[:, :, 0], v[:, :, 0], cos, sin, self.dense_k[layer],
                                   self.dense_v[layer], step.slots_t, counts.write_index, backend=self.backend)
            if self._query_weights is not None:
                self._track_queries(layer, q[:, :, None])
            o = kernels.decode_attention(q, self.formats[layer], self._tiers(layer, counts), scale,
                                         window=self.sliding_window, backend=self.backend)
            return o[:, :, None].to(q.dtype)
        if rope is not None:
            q, k = (kernels.apply_rope(x, *rope, backend=self.backend) for x in (q, k))
        if self._query_weights is not None:
            self._track_queries(layer, q)
        step.pending[layer] = (k, v)
        if not any(self._lengths[s] for s in step.slots):
            return kernels.causal_attention(q, k, v, self.sliding_window)
        # A block after stored tokens (a prefill chunk, a teacher-forced block): the stored tokens
        # are read back dense, pages decoded, for one tensor-core attention call per row. (The
        # decode kernel, built for a few query rows, would read the pages again for every 64
        # query rows: 14x slower for an 8k prompt in 512-token chunks on an H100.)
        return torch.cat([kernels.causal_attention(q[row:row + 1], *self._stored_then(layer, s, k[row], v[row]),
                                                   self.sliding_window) for row, s in enumerate(step.slots)])

    def _track_queries(self, layer: int, q: torch.Tensor) -> None:
        """Update the rows' mean |q| per kv-head channel: a block sets it to the block's mean, a
        decode step moves it 1/128 of the way (a page's worth of steps)."""
        B, Hq, T, D = q.shape
        new = q.detach().float().abs().view(B, self.n_kv_heads, Hq // self.n_kv_heads, T, D).mean((2, 3))
        w, rows = self._query_weights[layer], self._step.slots_t
        w[rows] = new if T > 1 else w[rows] + (new - w[rows]) / PAGE_TOKENS

    def _stored_then(self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [1, H, L + T, D] of a slot's L stored tokens (sink, decoded pages,
        recent) followed by the step's new k, v [H, T, D], in the dtype of k."""
        S, fmt = self.sink, self.formats[layer]
        n_sink, n_pages, n_recent = tier_counts(self._lengths[slot], S, self.windows[layer])
        dk, dv = self.dense_k[layer], self.dense_v[layer]
        keys, values = [dk[slot, :, :n_sink]], [dv[slot, :, :n_sink]]
        if n_pages:
            ids = self.page_table[slot, :n_pages].long()
            for out, codec, pages in ((keys, fmt.k, self.k_pages[layer]), (values, fmt.v, self.v_pages[layer])):
                x = codec.decode({name: f[ids] for name, f in pages.items()})  # [P, H, 128, D]
                out.append(codec.unrotate(x.transpose(0, 1).reshape(self.n_kv_heads, n_pages * PAGE_TOKENS, -1)))
        keys.append(dk[slot, :, S:S + n_recent])
        values.append(dv[slot, :, S:S + n_recent])
        return (torch.cat([*(t.to(k.dtype) for t in keys), k], dim=1)[None],
                torch.cat([*(t.to(v.dtype) for t in values), v], dim=1)[None])

    def _tiers(self, layer: int, counts: StepCounts) -> kernels.Tiers:
        S, width = self.sink, self._step.table_pages
        R = S + self.recent_view_tokens(width)[layer]
        dk, dv = self.dense_k[layer], self.dense_v[layer]
        return kernels.Tiers(dk[:, :, :S], dv[:, :, :S], counts.n_sink, self.k_pages[layer], self.v_pages[layer],
                             self.page_table[:, :width], counts.n_pages, dk[:, :, S:R], dv[:, :, S:R],
                             counts.n_recent, self._step.slots_t, recent_grows=self.windows[layer].per_mille > 0)

    def end_step(self) -> None:
        """Commit the step's tokens: place them in the tiers and encode every full page."""
        step, self._step = self._step, None
        if step.n_new == 1:
            # Which rows flush depends only on the window: decide, and flush, once per distinct window.
            for window in self._flush_groups:
                if full := self._rows_to_flush(step.slots, window):
                    self._flush_decode(window, full)
        else:
            for layer in range(self.n_layers):
                self._store_block(layer, step)
        for s in step.slots:
            self._lengths[s] += step.n_new

    def _rows_to_flush(self, slots: list[int], window: Window) -> list[tuple[int, int, int]]:
        """(slot, index of its next page, recent tokens left after the flush) of each row whose
        recent tier this decode step filled to its window + 128 tokens."""
        full = []
        for s in slots:
            L = self._lengths[s]
            n_pages = pages_for(L, self.sink, window)
            if pages_for(L + 1, self.sink, window) > n_pages:
                full.append((s, n_pages, window.at(L)))
        return full

    def _flush_decode(self, window: Window, full: list[tuple[int, int, int]]) -> None:
        """Encode the oldest 128 recent tokens of these rows into their next pages, in this window's layers.
        A flush comes once every 128 decode steps and the GPU waits for all of it: one launch per
        layer and side cost Llama-3-8B's 32 layers 9.6 ms of host time and, for Kitty's keys (8
        programs a launch), 1.3 ms of GPU time. So every layer that shares a codec is encoded in one
        launch, reading its tiles in place from the dense buffer, and the shift is one copy per group of
        layers (below)."""
        rows = to_device([s for s, _, _ in full], self.device)
        self._encode_recent(window, rows, to_device([self._pages[s][n] for s, n, _ in full], self.device))
        # Shift the remaining tokens to the front of the recent tier (the most any row keeps:
        # rows that keep fewer copy a few stale tokens past their end, which nothing reads).
        # The copy goes through a temporary, so it is cut into groups of layers of at most 64 MiB.
        S, R, dense = self.sink, max(left for _, _, left in full), self._dense[window]
        per_layer = max(1, 2 * self.n_kv_heads * R * self.head_dim * dense.element_size() * len(full))
        group = max(1, (64 << 20) // per_layer)
        for g in range(0, dense.shape[1] if R else 0, group):
            at = (slice(None), slice(g, g + group), rows, slice(None))
            dense[at + (slice(S, S + R),)] = dense[at + (slice(S + PAGE_TOKENS, S + PAGE_TOKENS + R),)]

    def _encode_recent(self, window: Window, rows: torch.Tensor, page_ids: torch.Tensor) -> None:
        """Encode the oldest 128 recent tokens of these rows [N] into these pages [N] in the layers of
        this window."""
        S, slots, pages = self.sink, self.max_seqs + 1, self.pool.num_pages
        for side, codec, fields, layers, in_window, in_group in self._flush_groups[window]:
            # tile (layer, row) is row in_window * slots + row of the window's dense buffer seen as
            # [layers x slots, ...] and goes to page in_group * pages + page of the group's fields seen
            # as [layers x pages, ...]
            tiles = self._dense[window][side].flatten(0, 1)[:, :, S:S + PAGE_TOKENS]
            weights = (self._query_weights[layers[:, None], rows[None, :]].flatten(0, 1)
                       if side == 0 and codec.needs_queries else None)
            kernels.encode_pages(codec, tiles, fields, (in_group[:, None] * pages + page_ids[None, :]).flatten(),
                                 backend=self.backend, query_weight=weights,
                                 rows=(in_window[:, None] * slots + rows[None, :]).flatten())

    def warm_up(self) -> None:
        """Compile the page encoder of the flush now: otherwise a sequence whose prompt filled no
        page compiles it at its first flush, mid-generation (seconds on a cold Triton cache). It
        encodes the scratch slot's recent tier into page 0, which no sequence holds yet; a page is
        always written before it is read. Only compiled kernels on a GPU need it."""
        if self.device.type != "cuda" or kernels.pick_backend(self.device, self.backend) != "triton":
            return
        if self.pool.num_free != self.pool.num_pages:
            raise RuntimeError("warm_up writes page 0: call it before any sequence is admitted")
        if self.pool.num_pages:
            for window in self._flush_groups:
                self._encode_recent(window, to_device([self.scratch_slot], self.device), to_device([0], self.device))

    def _store_block(self, layer: int, step: "_Step") -> None:
        """Place T new tokens per row: fill the sink, then append to the recent tier, encoding
        the oldest full pages until at most window + 127 tokens stay unencoded."""
        k_new, v_new = step.pending.pop(layer)
        window, S = self.windows[layer], self.sink
        dk, dv = self.dense_k[layer], self.dense_v[layer]
        T = k_new.shape[2]
        for row, s in enumerate(step.slots):
            L = self._lengths[s]
            _, n_pages, n_recent = tier_counts(L, S, window)
            to_sink = max(0, min(S - L, T))
            dk[s, :, L:L + to_sink] = k_new[row, :, :to_sink].to(self.dtype)
            dv[s, :, L:L + to_sink] = v_new[row, :, :to_sink].to(self.dtype)
            tail_k = torch.cat([dk[s, :, S:S + n_recent], k_new[row, :, to_sink:].to(self.dtype)], dim=1)
            tail_v = torch.cat([dv[s, :, S:S + n_recent], v_new[row, :, to_sink:].to(self.dtype)], dim=1)
            n_full = pages_for(L + T, S, window) - n_pages
            if n_full:
                H, D = self.n_kv_heads, self.head_dim
                tiles_k = tail_k[:, : n_full * PAGE_TOKENS].reshape(H, n_full, PAGE_TOKENS, D).transpose(0, 1)
                tiles_v = tail_v[:, : n_full * PAGE_TOKENS].reshape(H, n_full, PAGE_TOKENS, D).transpose(0, 1)
                slots = to_device([s] * n_full, self.device) if self._query_weights is not None else None
                self._write_pages(layer, tiles_k, tiles_v, self._pages[s][n_pages:n_pages + n_full], slots)
            keep = tail_k.shape[1] - n_full * PAGE_TOKENS
            dk[s, :, S:S + keep] = tail_k[:, n_full * PAGE_TOKENS:]
            dv[s, :, S:S + keep] = tail_v[:, n_full * PAGE_TOKENS:]

    def _write_pages(self, layer: int, k_tiles: torch.Tensor, v_tiles: torch.Tensor, page_ids: list[int],
                     slots: torch.Tensor | None) -> None:
        """Encode tiles [N, H, 128, D] of these slots [N] (needed only for the queries' weights,
        where the format ranks by them) into these pages."""
        ids = to_device(page_ids, self.device)
        fmt = self.formats[layer]
        query_weight = self._query_weights[layer][slots] if self._query_weights is not None else None
        kernels.encode_pages(fmt.k, k_tiles, self.k_pages[layer], ids, backend=self.backend, query_weight=query_weight)
        kernels.encode_pages(fmt.v, v_tiles, self.v_pages[layer], ids, backend=self.backend)

    # ---- reporting -------------------------------------------------------------------------

    def kv_stats(self, lengths: list[int] | None = None) -> dict:
        """Bytes held per tier (per layer and in total) over the live sequences, or over
        sequences of these lengths, and bits per cached element; full-precision tiers count
        their real dtype."""
        H, D, S = self.n_kv_heads, self.head_dim, self.sink
        token_bytes = 2 * H * D * self.dtype.itemsize  # K and V of one token in a dense tier
        live = lengths if lengths is not None else [self._lengths[s] for s, p in enumerate(self._pages) if p is not None]
        layers = []
        for layer, (fmt, window) in enumerate(zip(self.formats, self.windows)):
            tiers = {"sink": 0, "pages": 0, "recent": 0}
            tokens = 0
            for L in live:
                n_sink, n_pages, n_recent = tier_counts(L, S, window)
                tiers["sink"] += n_sink * token_bytes
                tiers["pages"] += n_pages * fmt.page_bytes(H, D)
                tiers["recent"] += n_recent * token_bytes
                tokens += L
            total = sum(tiers.values())
            layers.append({**tiers, "total": total, "tokens": tokens,
                           "bits_per_element": total * 8 / (2 * H * D * tokens) if tokens else 0.0})
        sums = {key: sum(l[key] for l in layers) for key in ("sink", "pages", "recent", "total")}
        elements = sum(2 * H * D * l["tokens"] for l in layers)
        return {
            "method": self.fmt.name,
            "layers": layers,
            **sums,
            "bits_per_element": sums["total"] * 8 / elements if elements else 0.0,
            "page_bits_per_element": sum(f.bits_per_element(H, D) for f in self.formats) / self.n_layers,
            "pool_pages": self.pool.num_pages,
            "free_pages": self.pool.num_free,
        }


class StepCounts(NamedTuple):
    """Device views [rows] of what one step's attention sees in the layers of one window."""

    write_index: torch.Tensor  # where a decode step's token goes in the slot's dense buffer
    n_sink: torch.Tensor
    n_pages: torch.Tensor
    n_recent: torch.Tensor


class _Step:
    """One forward's rows: slots (host list and device view), per distinct window the device
    buffer [StepCounts fields, rows] of the counts of each row, and the page table's width."""

    def __init__(self, slots: list[int], n_new: int, slots_t: torch.Tensor, counts: torch.Tensor, table_pages: int):
        self.slots, self.n_new, self.slots_t, self.counts = slots, n_new, slots_t, counts
        self.table_pages = table_pages  # page-table columns a decode step's attention sees
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _step_counts(lengths: torch.Tensor, sink: int, window: Window, n_new: int) -> torch.Tensor:
    """StepCounts' fields x rows: what the attention of a step sees for rows of `lengths`
    stored tokens (the tensor form of tier_counts). A decode step's token (n_new == 1)
    is written before the attention: into the sink while it has room, else after the recent
    tier; a block's tokens are not stored yet."""
    n_sink = lengths.clamp(max=sink)
    n_pages = (lengths - sink - window.tokens_t(lengths)).clamp(min=0) // PAGE_TOKENS
    n_recent = lengths - n_sink - n_pages * PAGE_TOKENS
    in_sink = lengths < sink
    write_idx = torch.where(in_sink, lengths, sink + n_recent)
    if n_new == 1:
        n_sink, n_recent = n_sink + in_sink, n_recent + ~in_sink
    return torch.stack([write_idx, n_sink, n_pages, n_recent])


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A list of ints on the device without waiting for the GPU: staged in pinned memory, copied
    asynchronously (the pinned block is not reused before its copy has run)."""
    t = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _alloc_layer_fields(codecs: list, num_pages: int, heads: int, head_dim: int, device
                        ) -> tuple[list[dict[str, torch.Tensor]], list[tuple[object, list[int], dict[str, torch.Tensor]]]]:
    """The page fields of each layer (codecs: one per layer), allocated once per distinct codec as
    [layers, num_pages, *shape]: each layer's fields [num_pages, *shape] (views), and per codec its
    layers and fields seen as [layers x num_pages, *shape]."""
    by_codec: dict[object, list[int]] = {}
    for layer, codec in enumerate(codecs):
        by_codec.setdefault(codec, []).append(layer)
    per_layer: list[dict[str, torch.Tensor]] = [{} for _ in codecs]
    groups = []
    for codec, layers in by_codec.items():
        fields = {name: torch.zeros((len(layers), num_pages, *shape), dtype=dtype, device=device)
                  for name, (shape, dtype) in codec.field_specs(heads, head_dim).items()}
        for i, layer in enumerate(layers):
            per_layer[layer] = {name: t[i] for name, t in fields.items()}
        groups.append((codec, layers, {name: t.flatten(0, 1) for name, t in fields.items()}))
    return per_layer, groups


def _flush_groups(layers: list[int], groups_by_side: dict, device: torch.device
                  ) -> list[tuple[int, object, dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]]:
    """What a flush of one window's layers touches, uploaded once: per side (0 keys, 1 values) and
    codec, the codec, its fields [layers x pages, ...], its layers among the window's [n], and their
    positions in the window's dense buffer [n] and in the codec's fields [n]."""
    out = []
    for side, groups in groups_by_side.items():
        for codec, group_layers, fields in groups:
            mine = [layer for layer in group_layers if layer in layers]
            if mine:
                out.append((side, codec, fields, to_device(mine, device),
                            to_device([layers.index(layer) for layer in mine], device),
                            to_device([group_layers.index(layer) for layer in mine], device)))
    return out


def _fill_random(t: torch.Tensor, name: str) -> None:
    if t.dtype.is_floating_point:
        t.uniform_(0.01, 0.1)  # scales, zeros, factors: small positive numbers
    elif name == "ids":
        t.copy_(torch.arange(t.shape[-1], device=t.device).expand_as(t))  # distinct boosted channels
    else:
        t.random_(0, 2**7)
