"""Where K and V live: three tiers per sequence and layer, in memory allocated once.

    sink    the first `sink` tokens, full precision (attention sinks)
    pages   every older token, 128 per page, in the chosen quant/ format
    recent  the newest `window` .. `window`+127 tokens, full precision

Tokens enter at the end. When the recent tier reaches window + 128 tokens its oldest 128 are
encoded into one page (once every 128 decode steps), so a page never changes after it is
written. The sink and the recent tier of a sequence are two views of one dense buffer per
layer, [slots, kv_heads, sink + window + 128, head_dim]. Pages come from a pool sized from a
memory budget with the format's real bytes per page; page j of a sequence holds its tokens
sink + 128 j .. sink + 128 j + 127 in every layer, so one page table serves all layers, even
when layers keep windows of different lengths (KVmix).

The model calls `attend(layer, q, k, v)` once per layer; the engine brackets a forward with
`begin_step(slots, n_new)` and `end_step()`, and manages sequences with `admit` / `release`.
The cache is method-agnostic: the format encodes pages, kernels/ attends over them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels
import quant
from kvcache.pool import PagePool

PAGE = quant.PAGE_TOKENS


class KVCache:
    def __init__(
        self,
        *,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        kv: str = "fp16",
        sink: int = 32,
        window: int = 128,
        max_seqs: int = 8,
        max_seq_len: int = 4096,
        budget_bytes: int | None = None,
        num_pages: int | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        sliding_window: int | None = None,
        kv_plan: str | dict | None = None,
        backend: str = "auto",
    ):
        fmt = quant.get_format(kv, **({"plan": kv_plan, "n_layers": n_layers} if kv == "kvmix" else {}))
        self.kv = kv
        if kv.endswith("-nosink"):  # e.g. KIVI as published: no full-precision sink tokens
            sink = 0
        self.formats = [fmt.for_layer(i) for i in range(n_layers)]
        self.windows = _layer_windows(fmt, window, n_layers)
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.sink, self.max_seqs, self.max_seq_len = sink, max_seqs, max_seq_len
        self.sliding_window = sliding_window
        self.device, self.dtype = torch.device(device), dtype
        self.backend = None if backend == "auto" else backend

        dense_tokens = sink + max(self.windows) + PAGE
        self.dense_bytes = (max_seqs + 1) * slot_bytes(n_layers, n_kv_heads, head_dim, sink, max(self.windows), dtype)
        self.page_bytes = sum(f.page_bytes(n_kv_heads, head_dim) for f in self.formats)
        if num_pages is None:
            if budget_bytes < self.dense_bytes:
                raise ValueError(
                    f"a KV budget of {budget_bytes / 2**30:.2f} GiB cannot even hold the full-precision sink and "
                    f"recent tiers of {max_seqs} sequences ({self.dense_bytes / 2**30:.2f} GiB): raise --kv-budget-gb "
                    "or lower --max-batch"
                )
            num_pages = (budget_bytes - self.dense_bytes) // self.page_bytes
        self.pool = PagePool(num_pages)

        # Row max_seqs of the dense buffers and the page table is a scratch slot: padding rows
        # of a CUDA-graph batch bucket write there, never into a live sequence.
        self.scratch_slot = max_seqs
        shape = (max_seqs + 1, n_kv_heads, dense_tokens, head_dim)
        self.dense_k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(n_layers)]
        self.dense_v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(n_layers)]
        self.k_pages = [_alloc_fields(f.k, num_pages, n_kv_heads, head_dim, self.device) for f in self.formats]
        self.v_pages = [_alloc_fields(f.v, num_pages, n_kv_heads, head_dim, self.device) for f in self.formats]
        self.max_pages_per_seq = self.pages_needed(max_seq_len)
        self.page_table = torch.zeros(max_seqs + 1, max(1, self.max_pages_per_seq), dtype=torch.int32, device=self.device)
        # Per-step inputs of the attention live in fixed buffers, so that a captured CUDA graph
        # replays a decode step once begin_step has refreshed them.
        self._window_row = {R: i for i, R in enumerate(sorted(set(self.windows)))}
        self._step_slots = torch.zeros(max_seqs, dtype=torch.long, device=self.device)
        self._step_counts = torch.zeros(len(self._window_row), 4, max_seqs, dtype=torch.int32, device=self.device)

        # Tokens stored per slot, kept twice: on the host for scheduling and flush decisions, on
        # the device for the attention's tier counts, so neither side waits for the other.
        self.lengths = [0] * max_seqs
        self.seq_lens = torch.zeros(max_seqs + 1, dtype=torch.long, device=self.device)
        self._uploaded_slots: list[int] = []
        self._reserved = [0] * max_seqs  # tokens each slot was admitted for
        self._pages: list[list[int] | None] = [None] * max_seqs  # reserved page ids per slot; None = free slot
        self._step: _Step | None = None

    # ---- sequences -------------------------------------------------------------------------

    def pages_needed(self, n_tokens: int) -> int:
        """Pages a sequence of n_tokens occupies at most (the layer with the shortest window)."""
        return pages_for(n_tokens, self.sink, min(self.windows))

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
        self.lengths[slot] = 0
        self.seq_lens[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        """Give a finished sequence's pages back to the pool and free its slot."""
        self.pool.release(self._pages[slot])
        self._pages[slot] = None
        self.lengths[slot] = 0

    @property
    def num_free_slots(self) -> int:
        return sum(p is None for p in self._pages)

    # ---- one forward -----------------------------------------------------------------------

    def begin_step(self, slots: list[int], n_new: int, rows: int | None = None, *, deferred: bool = False) -> None:
        """The next forward feeds n_new tokens to each of these slots (1 = a decode step).
        rows > len(slots) pads the batch with scratch rows (CUDA-graph batch buckets).

        This is the host half of a step: it checks the reservation and uploads the slots, only
        when they changed since the last step. The device half, step_on_device, reads the
        lengths on the GPU; it runs here unless `deferred`: then the caller's forward runs it,
        so that a CUDA graph of that forward replays it."""
        for s in slots:
            if self.lengths[s] + n_new > self._reserved[s]:
                raise ValueError(f"slot {s} was admitted for {self._reserved[s]} tokens; "
                                 f"{self.lengths[s] + n_new} would overflow its reserved pages")
        rows = rows or len(slots)
        padded = slots + [self.scratch_slot] * (rows - len(slots))
        if padded != self._uploaded_slots:
            self._step_slots[:rows].copy_(to_device(padded, self.device), non_blocking=True)
            self._uploaded_slots = padded
        self._step = _Step(slots, n_new, self._step_slots[:rows], self._step_counts[:, :, :rows])
        if not deferred:
            self.step_on_device()

    def step_on_device(self) -> torch.Tensor:
        """The device half of beginning a step, in GPU ops only so that a CUDA graph can replay
        it: each row's stored length gives the tier counts its attention sees, then advances by
        the step's tokens (scratch rows stay empty). Returns the new tokens' positions [rows, n_new]."""
        step = self._step
        lengths = self.seq_lens[step.slots_t]
        for R, i in self._window_row.items():
            step.counts[i] = _step_counts(lengths, self.sink, R, step.n_new)
        live = step.slots_t != self.scratch_slot
        self.seq_lens[step.slots_t] = lengths + live * step.n_new
        return lengths[:, None] + torch.arange(step.n_new, device=self.device)

    @property
    def step_slots(self) -> torch.Tensor:
        """The device slots of the current step's rows (scratch-padded)."""
        return self._step.slots_t

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of q [B, Hq, T, D] over everything stored for these rows plus the new k, v
        [B, H, T, D] (causal among the T new tokens). Stores k and v for end_step."""
        step = self._step
        scale = q.shape[-1] ** -0.5
        fmt = self.formats[layer]
        c = step.counts[self._window_row[self.windows[layer]]]
        if step.n_new == 1:
            # The kernels read the new token from the recent tier, so it is written first.
            kernels.store_token(self.dense_k[layer], self.dense_v[layer], k[:, :, 0], v[:, :, 0], step.slots_t, c[0],
                                backend=self.backend)
            o = self._decode_attention(layer, fmt, q[:, :, 0], c, scale)
            return o[:, :, None].to(q.dtype)
        step.pending[layer] = (k, v)
        if not any(self.lengths[s] for s in step.slots):
            return _self_attention(q, k, v, self.sliding_window)
        o_old, lse_old = self._decode_attention(layer, fmt, q, c, scale, return_lse=True)
        o_new, lse_new = _self_attention(q, k, v, self.sliding_window, with_lse=True)
        return kernels.merge_partials([(o_old, lse_old), (o_new.float(), lse_new)]).to(q.dtype)

    def _decode_attention(self, layer, fmt, q, c, scale, return_lse=False):
        S = self.sink
        dk, dv = self.dense_k[layer], self.dense_v[layer]
        return kernels.decode_attention(
            q, fmt, self.k_pages[layer], self.v_pages[layer], self.page_table, c[2],
            dk[:, :, :S], dv[:, :, :S], c[1], dk[:, :, S:], dv[:, :, S:], c[3], scale,
            slots=self._step.slots_t, window=self.sliding_window, return_lse=return_lse, backend=self.backend,
        )

    def end_step(self) -> None:
        """Commit the step's tokens: place them in the tiers and encode every full page."""
        step, self._step = self._step, None
        if step.n_new == 1:
            # Which rows flush depends only on the window, so decide once per distinct window.
            flushing = {R: self._rows_to_flush(step.slots, R) for R in self._window_row}
            for layer in range(self.n_layers):
                if flushing[self.windows[layer]]:
                    self._flush_decode(layer, flushing[self.windows[layer]])
        else:
            for layer in range(self.n_layers):
                self._store_block(layer, step)
        for s in step.slots:
            self.lengths[s] += step.n_new

    def _rows_to_flush(self, slots: list[int], window: int) -> list[tuple[int, int]]:
        """(slot, index of its next page) of each row whose recent tier this decode step filled
        to window + 128 tokens."""
        full = []
        for s in slots:
            L = self.lengths[s]
            if L >= self.sink:  # the step's token went to the recent tier, not the sink
                _, n_pages, n_recent = _tier_counts(L, self.sink, window)
                if n_recent + 1 == window + PAGE:
                    full.append((s, n_pages))
        return full

    def _flush_decode(self, layer: int, full: list[tuple[int, int]]) -> None:
        """Encode the oldest 128 recent tokens of these rows into their next pages."""
        R, S = self.windows[layer], self.sink
        rows = to_device([s for s, _ in full], self.device)
        page_ids = [self._pages[s][n] for s, n in full]
        dk, dv = self.dense_k[layer], self.dense_v[layer]
        self._write_pages(layer, dk[rows, :, S:S + PAGE], dv[rows, :, S:S + PAGE], page_ids)
        # Shift the remaining R tokens to the front of the recent tier.
        dk[rows, :, S:S + R] = dk[rows, :, S + PAGE:S + PAGE + R]
        dv[rows, :, S:S + R] = dv[rows, :, S + PAGE:S + PAGE + R]

    def _store_block(self, layer: int, step: "_Step") -> None:
        """Place T new tokens per row: fill the sink, then append to the recent tier, encoding
        the oldest full pages until at most window + 127 tokens stay unencoded."""
        k_new, v_new = step.pending.pop(layer)
        R, S = self.windows[layer], self.sink
        dk, dv = self.dense_k[layer], self.dense_v[layer]
        T = k_new.shape[2]
        for row, s in enumerate(step.slots):
            L = self.lengths[s]
            _, n_pages, n_recent = _tier_counts(L, S, R)
            to_sink = max(0, min(S - L, T))
            dk[s, :, L:L + to_sink] = k_new[row, :, :to_sink].to(self.dtype)
            dv[s, :, L:L + to_sink] = v_new[row, :, :to_sink].to(self.dtype)
            tail_k = torch.cat([dk[s, :, S:S + n_recent], k_new[row, :, to_sink:].to(self.dtype)], dim=1)
            tail_v = torch.cat([dv[s, :, S:S + n_recent], v_new[row, :, to_sink:].to(self.dtype)], dim=1)
            n_full = max(0, (tail_k.shape[1] - R) // PAGE)
            if n_full:
                H, D = self.n_kv_heads, self.head_dim
                tiles_k = tail_k[:, : n_full * PAGE].reshape(H, n_full, PAGE, D).transpose(0, 1)
                tiles_v = tail_v[:, : n_full * PAGE].reshape(H, n_full, PAGE, D).transpose(0, 1)
                self._write_pages(layer, tiles_k, tiles_v, self._pages[s][n_pages:n_pages + n_full])
            keep = tail_k.shape[1] - n_full * PAGE
            dk[s, :, S:S + keep] = tail_k[:, n_full * PAGE:]
            dv[s, :, S:S + keep] = tail_v[:, n_full * PAGE:]

    def _write_pages(self, layer: int, k_tiles: torch.Tensor, v_tiles: torch.Tensor, page_ids: list[int]) -> None:
        ids = to_device(page_ids, self.device)
        fmt = self.formats[layer]
        kernels.encode_pages(fmt.k, k_tiles, self.k_pages[layer], ids, backend=self.backend)
        kernels.encode_pages(fmt.v, v_tiles, self.v_pages[layer], ids, backend=self.backend)

    # ---- reporting -------------------------------------------------------------------------

    def kv_stats(self) -> dict:
        """Bytes held per tier (per layer and in total) over the live sequences, and bits per
        cached element; full-precision tiers count their real dtype."""
        H, D, S = self.n_kv_heads, self.head_dim, self.sink
        token_bytes = 2 * H * D * self.dtype.itemsize  # K and V of one token in a dense tier
        live = [self.lengths[s] for s, p in enumerate(self._pages) if p is not None]
        layers = []
        for layer, (fmt, R) in enumerate(zip(self.formats, self.windows)):
            tiers = {"sink": 0, "pages": 0, "recent": 0}
            tokens = 0
            for L in live:
                n_sink, n_pages, n_recent = _tier_counts(L, S, R)
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
            "method": self.kv,
            "layers": layers,
            **sums,
            "bits_per_element": sums["total"] * 8 / elements if elements else 0.0,
            "page_bits_per_element": sum(f.bits_per_element(H, D) for f in self.formats) / self.n_layers,
            "pool_pages": self.pool.num_pages,
            "free_pages": self.pool.num_free,
        }


class _Step:
    """One forward's rows: slots (host list and device view) and, per distinct window, the
    device view of [write index, sink, pages, recent] counts of each row."""

    def __init__(self, slots: list[int], n_new: int, slots_t: torch.Tensor, counts: torch.Tensor):
        self.slots, self.n_new, self.slots_t, self.counts = slots, n_new, slots_t, counts
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _step_counts(lengths: torch.Tensor, sink: int, window: int, n_new: int) -> torch.Tensor:
    """[write index, sink, pages, recent] x rows: what the attention of a step sees for rows of
    `lengths` stored tokens (the tensor form of _tier_counts). A decode step's token (n_new == 1)
    is written before the attention: into the sink while it has room, else after the recent
    tier; a block's tokens are not stored yet."""
    n_sink = lengths.clamp(max=sink)
    n_pages = (lengths - sink - window).clamp(min=0) // PAGE
    n_recent = lengths - n_sink - n_pages * PAGE
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


def pages_for(n_tokens: int, sink: int, window: int) -> int:
    """Pages a sequence of n_tokens holds once flushed: everything past the sink and the window,
    in whole pages."""
    return max(0, (n_tokens - sink - window) // PAGE)


def slot_bytes(n_layers: int, n_kv_heads: int, head_dim: int, sink: int, window: int, dtype: torch.dtype) -> int:
    """Bytes of one sequence slot's full-precision sink and recent buffers, K and V, all layers."""
    return n_layers * 2 * n_kv_heads * (sink + window + PAGE) * head_dim * dtype.itemsize


def _tier_counts(length: int, sink: int, window: int) -> tuple[int, int, int]:
    """(sink, page, recent) token counts of a flushed sequence of `length` tokens."""
    n_sink = min(length, sink)
    n_pages = pages_for(length, sink, window)
    return n_sink, n_pages, length - n_sink - n_pages * PAGE


def _layer_windows(fmt, window: int, n_layers: int) -> list[int]:
    """The recent window of each layer. KVmix gives layers a share of full-precision tokens in
    proportion to their importance: we scale R by each layer's window ratio over the smallest."""
    if not hasattr(fmt, "window_ratio"):
        return [window] * n_layers
    ratios = [fmt.window_ratio(i) for i in range(n_layers)]
    return [round(window * r / min(ratios)) for r in ratios]


def _alloc_fields(codec, num_pages: int, heads: int, head_dim: int, device) -> dict[str, torch.Tensor]:
    return {
        name: torch.zeros((num_pages, *shape), dtype=dtype, device=device)
        for name, (shape, dtype) in codec.field_specs(heads, head_dim).items()
    }


def _self_attention(q, k, v, window: int | None, with_lse: bool = False):
    """Causal attention of T new queries over the same T new keys (GQA, optional window).
    With with_lse, also the log-sum-exp of each row's logits so it can merge with the tiers."""
    T = q.shape[-2]
    if not with_lse and (window is None or window >= T):
        return F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=True)
    i = torch.arange(T, device=q.device)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed &= i[:, None] - i[None, :] < window
    if not with_lse:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    G = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(G, dim=1)
    vf = v.float().repeat_interleave(G, dim=1)
    s = (q.float() @ kf.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.softmax(s, dim=-1) @ vf, lse
