"""Torch reference of the kernels: tiered decode attention, causal attention among new tokens,
page encoding, and the model's per-token arithmetic (RMSNorm, residual add + RMSNorm, RoPE, SiLU gate, a decode step's RoPE with the store of its K and V).

This is the oracle the Triton kernels are tested against and the path the cache takes
off-GPU. It favours clarity over speed but is batched and vectorised: pages are gathered
through the page table, decoded with the format's torch codec, and every tier (FP16 sink,
quantized pages, FP16 recent window) gets its own partial softmax (o, lse); the partials
are merged with the log-sum-exp trick, exactly as the split-K kernel merges its splits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from torch import Tensor

from quant import PAGE_TOKENS


class Tiers(NamedTuple):
    """What decode attention reads for a batch, besides q: every row's stored tokens in three
    tiers. Row b reads slot slots[b] of the page table and of the sink/recent buffers (slots None:
    slot b). Counts are int32 [B] tensors; n_pages counts pages, the others tokens."""

    sink_k: Tensor  # [slots, H, >= n_sink, D] full precision
    sink_v: Tensor
    n_sink: Tensor
    k_pages: dict[str, Tensor]  # the pool's fields of the format's K codec, [num_pages, *field shape]
    v_pages: dict[str, Tensor]
    page_table: Tensor  # int32 [slots, max pages]: pool page ids of each slot's pages, in order
    n_pages: Tensor
    recent_k: Tensor  # [slots, H, >= n_recent, D] full precision, the tokens after the pages
    recent_v: Tensor
    n_recent: Tensor
    slots: Tensor | None = None
    # the recent tier is a share of each row's length (KVmix), so its view, and with it the
    # launch's recent-tier programs, grows from step to step (a fixed window's never changes)
    recent_grows: bool = False


def partial_attention(q: Tensor, k: Tensor, v: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax attention restricted to the valid keys of each batch row.

    q [B, H, M, D] (already scaled), k/v [B, H, N, D], valid bool [B, N] or, per query, [B, M, N].
    Returns o [B, H, M, D] and lse [B, H, M] (natural log); a row with no valid key
    gets o = 0 and lse = -inf so that it drops out of the merge.
    """
    mask = valid[:, None, None, :] if valid.dim() == 2 else valid[:, None]
    s = (q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    # exp(-inf - 0) = 0 keeps empty rows at o = 0 instead of NaN.
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return p @ v, lse


def merge_partials(parts: list[tuple[Tensor, Tensor]], with_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Combine partial (o, lse) pairs over disjoint key sets into the full softmax output
    (and, with_lse, the log-sum-exp over all of them)."""
    o = torch.stack([p[0] for p in parts])
    lse = torch.stack([p[1] for p in parts])
    m = lse.amax(dim=0)
    m_safe = torch.where(torch.isfinite(m), m, 0.0)
    w = torch.exp(lse - m_safe[None])
    total = w.sum(0)
    out = (w[..., None] * o).sum(0) / total.clamp_min(torch.finfo(total.dtype).tiny)[..., None]
    return (out, m_safe + torch.log(total)) if with_lse else out


def gather_pages(codec, pages: dict[str, Tensor], page_table: Tensor, n_pages: Tensor) -> Tensor:
    """Decode the first max(n_pages) pages of every batch row into [B, H, P*T, D] float32.

    Entries of the page table past a row's n_pages are garbage (maybe out of range), so
    they are replaced by page 0 before the gather; the caller masks those tokens.
    """
    p_max = int(n_pages.max())
    cols = torch.arange(p_max, device=page_table.device)
    ids = torch.where(cols < n_pages[:, None], page_table[:, :p_max], 0).long()
    x = codec.decode({name: f[ids] for name, f in pages.items()})  # [B, P, H, T, D]
    b, p, h, t, d = x.shape
    return x.permute(0, 2, 1, 3, 4).reshape(b, h, p * t, d)


def decode_attention(q: Tensor, fmt, tiers: Tiers, scale: float, *, window: int | None = None,
                     return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of q over the three tiers of every batch row.

    window: a sliding window (Mistral): a stored token at position p is visible to a query at
    position qpos only while qpos - p < window. return_lse: also return the log-sum-exp of each
    query's logits over the stored tokens, so a caller can merge in attention over tokens that
    are not stored yet.

    q is [B, Hq, D] for one decode step, or [B, Hq, T, D] for T queries that all see every
    stored token (teacher-forced blocks). KV head h serves q heads h*G .. h*G+G-1 (GQA).
    Pages are in fmt's rotated domain when fmt.rotated: q is rotated for them and their
    partial output rotated back before the merge. Computed in float32, returned in q.dtype.
    """
    sink_k, sink_v, n_sink, k_pages, v_pages, page_table, n_pages, recent_k, recent_v, n_recent, slots, _ = tiers
    single = q.dim() == 3
    q4 = q[:, :, None] if single else q
    B, Hq, T, D = q4.shape
    if slots is not None:
        rows = slots.long()
        page_table, sink_k, sink_v, recent_k, recent_v = (
            t[rows] for t in (page_table, sink_k, sink_v, recent_k, recent_v))
    H = sink_k.shape[1]
    G = Hq // H
    # [B, H, G*T, D]: the q heads of one KV head are just more query rows for it.
    qf = q4.float().reshape(B, H, G * T, D) * scale
    # Query positions for the sliding window: the stored tokens precede the queries; in a
    # decode step (single) the query's own token is already the last stored one.
    stored = n_sink + n_pages * PAGE_TOKENS + n_recent
    qpos = stored[:, None] - 1 if single else stored[:, None] + torch.arange(T, device=q.device)

    def visible(pos: Tensor, n: Tensor) -> Tensor:
        """Mask of stored positions pos [B, N] (the first n[b] of each row): [B, N], the same for
        every query, or with a sliding window [B, G*T, N], per query."""
        ok = torch.arange(pos.shape[1], device=q.device) < n[:, None]
        if window is None:
            return ok
        ok = ok[:, None, :] & (qpos[:, :, None] - pos[:, None, :] < window)
        return ok.repeat(1, G, 1)

    def dense(k: Tensor, v: Tensor, n: Tensor, first: Tensor) -> tuple[Tensor, Tensor]:
        pos = first[:, None] + torch.arange(k.shape[2], device=q.device)
        return partial_attention(qf, k.float(), v.float(), visible(pos, n))

    zero = torch.zeros_like(n_sink)
    parts = [dense(sink_k, sink_v, n_sink, zero),
             dense(recent_k, recent_v, n_recent, n_sink + n_pages * PAGE_TOKENS)]
    if page_table.shape[1] > 0 and int(n_pages.max()) > 0:
        k = gather_pages(fmt.k, k_pages, page_table, n_pages)
        v = gather_pages(fmt.v, v_pages, page_table, n_pages)
        pos = n_sink[:, None] + torch.arange(k.shape[2], device=q.device)
        o, lse = partial_attention(fmt.rotate(qf), k, v, visible(pos, n_pages * PAGE_TOKENS))
        parts.append((fmt.unrotate(o), lse))
    o, lse = merge_partials(parts, with_lse=True)
    o = o.reshape(B, Hq, T, D).to(q.dtype)
    lse = lse.reshape(B, Hq, T)
    if single:
        o, lse = o[:, :, 0], lse[:, :, 0]
    return (o, lse) if return_lse else o


def causal_mask(n: int, window: int | None, device: torch.device, keys: int | None = None) -> Tensor:
    """[n, keys] bool for n queries that are the last n of `keys` positions (default keys = n):
    query i, at position p = keys - n + i, sees key j when j <= p and, with a sliding window,
    p - j < window."""
    keys = n if keys is None else keys
    p = torch.arange(n, device=device)[:, None] + (keys - n)
    j = torch.arange(keys, device=device)[None, :]
    allowed = j <= p
    return allowed if window is None else allowed & (p - j < window)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor:
    """Causal attention of T queries q [B, Hq, T, D] over S >= T keys k, v [B, H, S, D] whose
    last T are the queries' own tokens (GQA, an optional sliding window). S > T: a block of new
    tokens after stored ones (chunked prefill), whose keys were read back from the cache."""
    T, S = q.shape[-2], k.shape[-2]
    if S == T and (window is None or window >= T):
        return F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=True)
    if S > T:  # a mask and GQA together would fall back to the math kernel: give each q head its keys
        G = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    if window is None:  # lower-right causal, without materializing the mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, S))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(T, window, q.device, keys=S), enable_gqa=True)


def encode_pages_reference(codec, x: Tensor, pool_fields: dict[str, Tensor], page_ids: Tensor,
                           query_weight: Tensor | None = None, rows: Tensor | None = None) -> None:
    """Encode N tiles x [N, H, T, D] (or x[rows] [N]) with the torch codec and write them to pool
    pages page_ids [N]."""
    if rows is not None:
        x = x[rows.long()]
    fields = codec.encode(x, query_weight) if codec.needs_queries else codec.encode(x)
    for name, dst in pool_fields.items():
        dst[page_ids.long()] = fields[name].to(dst.dtype)


# ---- the model's per-token arithmetic (kernels/elementwise.py) ---------------------------------

def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim, in fp32; the normalised row is rounded to x's dtype before the
    weight multiplies it (HF's Llama order)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x: Tensor, h: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The residual add and the RMSNorm of its (rounded) sum: (x + h, rms_norm(x + h))."""
    total = x + h
    return total, rms_norm(total, weight, eps)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs (i, i + D/2) by the position angle: HF's rotate_half convention."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return torch.nn.functional.silu(gate) * up


def rope_store(q: Tensor, k: Tensor, v: Tensor, cos: Tensor | None, sin: Tensor | None, dense_k: Tensor,
               dense_v: Tensor, slots: Tensor, index: Tensor) -> Tensor:
    """A decode step's q [B, Hq, D] and k [B, H, D] rotated by cos/sin [B, D] (None: not rotated);
    the rotated k and v of row b written into dense_k/v[slots[b], :, index[b]]. Returns the rotated q."""
    if cos is not None:
        q, k = apply_rope(q, cos[:, None], sin[:, None]), apply_rope(k, cos[:, None], sin[:, None])
    dense_k[slots, :, index.long()] = k.to(dense_k.dtype)
    dense_v[slots, :, index.long()] = v.to(dense_v.dtype)
    return q


def argmax(x: Tensor) -> Tensor:
    """Index of each row's maximum, x [rows, n] -> int64 [rows] (the first on ties)."""
    return x.argmax(-1)
