"""The KV cache's three tiers (sink, quantized pages, recent window) against independent oracles.

The rule: the first S tokens of a sequence are its sink; later tokens join
the recent tier, and each time that tier reaches R + 128 tokens its oldest 128 become one page.
So once a sequence is past S + R tokens the recent tier holds R..R+127 of them. A prefill block
ends in the same state as the same tokens fed one by one.

Oracles (written here; none of them reads the cache's state or calls its helpers):
- TierRule: that rule in plain python, token by token, over token positions;
- direct_attention: a float64 softmax over [sink | quant/ round trip of each 128-token group |
  recent], each group encoded on its own with quant/ (rotated formats are rotated back, since
  the rotation is orthonormal), with the causal mask written out;
- DirectTiers: the same thing as a cache object a model can run on instead of the KVCache;
- the model's own causal SDPA (cache=None) over fp16-rounded K/V, for the fp16 tiers.

Most tests feed the cache random K/V directly through begin_step / attend / end_step, with tiny
shapes, so that hundreds of steps stay fast; the engine and model tests use tiny random llamas,
and the Kitty test the real default model (SmolLM2) on real English text.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import kernels
import loading
import quant
from kvcache import KVCache
from kvcache.cache import StepCounts
from llm import LLM
from quant import PAGE_TOKENS
from sampling import SamplingParams
from tests.tiny_models import make_tiny_model

LAYERS, H, HQ, D = 2, 2, 4, 16  # GQA: two q heads per kv head
QUANT_METHODS = ["kivi-k2v2", "kitty", "kvarn", "nqkv"]
ATTN_ATOL = 1e-5  # fp32 cache against the float64 oracle on unit-scale values: op order only
LOGIT_ATOL = 1e-4  # fp32 model logits, same tokens and values, different op order


# ---- oracles -------------------------------------------------------------------------------

class TierRule:
    """The tier rule in plain python: which token positions sit in the sink, each page, the recent tier."""

    def __init__(self, sink: int, window: int, per_mille: int = 0):
        """window: recent tokens kept; per_mille: or that share of the sequence's length (in
        thousandths, floored) where that is more: KVmix's recent pivotal context."""
        self.S, self.R, self.per_mille = sink, window, per_mille
        self.sink: list[int] = []
        self.pages: list[list[int]] = []
        self.recent: list[int] = []

    @property
    def length(self) -> int:
        return len(self.sink) + PAGE_TOKENS * len(self.pages) + len(self.recent)

    def add(self, n: int) -> None:
        for _ in range(n):
            p = self.length
            (self.sink if len(self.sink) < self.S else self.recent).append(p)
            if len(self.recent) == max(self.R, self.length * self.per_mille // 1000) + PAGE_TOKENS:
                self.pages.append(self.recent[:PAGE_TOKENS])
                self.recent = self.recent[PAGE_TOKENS:]


def round_trip(codec: quant.TileCodec, x: torch.Tensor) -> torch.Tensor:
    """What a page gives back for the tile x [H, 128, D], in the original (un-rotated) domain."""
    return codec.unrotate(codec.decode(codec.encode(x)))


def effective_kv(fmt, k, v, pages, memo: dict, key) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [H, N, D] with the tokens of each page (lists of positions) replaced by quant/'s round trip."""
    k, v = k.clone(), v.clone()
    for group in pages:
        if (key, group[0]) not in memo:  # a page never changes: encode each group once
            memo[key, group[0]] = round_trip(fmt.k, k[:, group]), round_trip(fmt.v, v[:, group])
        k[:, group], v[:, group] = memo[key, group[0]]
    return k, v


def direct_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_old: int) -> torch.Tensor:
    """Softmax attention in float64 of q [HQ, T, D], query t sitting at position n_old + t, over
    k, v [H, n_old + T, D]: causal, GQA (q head h reads kv head h // (HQ / H))."""
    G = q.shape[0] // k.shape[0]
    k, v = k.double().repeat_interleave(G, 0), v.double().repeat_interleave(G, 0)
    s = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    T, N = q.shape[1], k.shape[1]
    visible = torch.arange(N)[None, :] <= n_old + torch.arange(T)[:, None]
    return torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1) @ v


class DirectTiers:
    """An oracle cache for one sequence: keeps every token's K/V in full and attends over
    [sink | decoded pages | recent] as TierRule places them, with direct_attention. The tokens
    of a step attend in full precision: a page is only written after the step."""

    def __init__(self, fmt: quant.KVFormat, sink: int, window: int, n_layers: int):
        self.fmt, self.rule = fmt, TierRule(sink, window)
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.memo: dict = {}

    def begin_step(self, slots: list[int], n_new: int) -> None:
        self.n_new = n_new

    def attend(self, layer: int, q, k, v, rope=None) -> torch.Tensor:
        if rope is not None:  # the cache contract: q and k arrive before the rotary embedding
            q, k = kernels.apply_rope(q, *rope), kernels.apply_rope(k, *rope)
        n_old = self.rule.length
        self.k[layer] = k[0] if n_old == 0 else torch.cat([self.k[layer], k[0]], dim=1)
        self.v[layer] = v[0] if n_old == 0 else torch.cat([self.v[layer], v[0]], dim=1)
        k_eff, v_eff = effective_kv(self.fmt.for_layer(layer), self.k[layer], self.v[layer], self.rule.pages,
                                    self.memo, layer)
        return direct_attention(q[0], k_eff, v_eff, n_old)[None].to(q.dtype)

    def end_step(self) -> None:
        self.rule.add(self.n_new)


# ---- driving the cache with known K/V --------------------------------------------------------

def make_cache(kv: str = "fp16", sink: int = 4, window: int = 8, max_seqs: int = 3, budget_mib: int = 8) -> KVCache:
    return KVCache(quant.get_format(kv), n_layers=LAYERS, n_kv_heads=H, head_dim=D, sink=sink, window=window,
                   max_seqs=max_seqs, max_seq_len=1024, budget_bytes=budget_mib * 2**20)


class Seq:
    """One sequence: its cache slot, its rule oracle, and the random q/k/v of all its positions."""

    def __init__(self, cache: KVCache, n_tokens: int, seed: int):
        self.slot = cache.admit(n_tokens)
        assert self.slot is not None
        # one oracle per layer: KVmix layers keep different windows
        self.rules = [TierRule(cache.sink, w.tokens, w.per_mille) for w in cache.windows]
        g = torch.Generator().manual_seed(seed)
        self.q = torch.randn(LAYERS, HQ, n_tokens, D, generator=g)
        self.k = torch.randn(LAYERS, H, n_tokens, D, generator=g)
        self.v = torch.randn(LAYERS, H, n_tokens, D, generator=g)

    @property
    def rule(self) -> TierRule:
        """Layer 0's oracle (every layer's, for a uniform format)."""
        return self.rules[0]


def feed(cache: KVCache, seqs: list[Seq], n_new: int, fmt=None, memo=None) -> None:
    """One forward of n_new tokens for each sequence (n_new = 1 is a decode step): begin_step,
    attend for every layer, end_step. With fmt, every attention output is checked against
    direct_attention over the tiers the rule implies before the step."""
    starts = [s.rule.length for s in seqs]
    cols = [slice(L, L + n_new) for L in starts]
    cache.begin_step([s.slot for s in seqs], n_new)
    for layer in range(LAYERS):
        q, k, v = (torch.stack([getattr(s, name)[layer, :, c] for s, c in zip(seqs, cols)]) for name in "qkv")
        out = cache.attend(layer, q, k, v)
        for row, (s, L) in enumerate(zip(seqs, starts) if fmt is not None else []):
            k_eff, v_eff = effective_kv(fmt.for_layer(layer), s.k[layer, :, :L + n_new], s.v[layer, :, :L + n_new],
                                        s.rules[layer].pages, memo, (layer, s.slot))
            expected = direct_attention(s.q[layer, :, cols[row]], k_eff, v_eff, L)
            where = f"{fmt.name}, slot {s.slot}, layer {layer}, tokens {L}..{L + n_new - 1}"
            torch.testing.assert_close(out[row].double(), expected, atol=ATTN_ATOL, rtol=0, msg=lambda m: f"{where}: {m}")
    cache.end_step()
    for s in seqs:
        for rule in s.rules:
            rule.add(n_new)


def check_tiers(cache: KVCache, seqs: list[Seq]) -> None:
    """The cache's tier counts (kv_stats) and contents equal what the rule says, for every
    sequence and layer: the sink and recent buffers hold exactly the K/V of the rule's positions,
    and each page decodes to its 128 positions' K/V through the codec (fp16: their fp16 values)."""
    S = cache.sink
    token_bytes = 2 * H * D * cache.dtype.itemsize
    stats = cache.kv_stats()
    for layer in range(LAYERS):
        fmt, got = cache.formats[layer], stats["layers"][layer]
        counts = (got["sink"] // token_bytes, got["pages"] // fmt.page_bytes(H, D), got["recent"] // token_bytes)
        want = tuple(sum(len(getattr(s.rules[layer], tier)) for s in seqs) for tier in ("sink", "pages", "recent"))
        lengths = [s.rule.length for s in seqs]
        assert counts == want, f"(sink, pages, recent) of layer {layer} at lengths {lengths}"
        for s in seqs:
            rule, where = s.rules[layer], f"layer {layer}, slot {s.slot} at length {s.rule.length}"
            for name, dense, pages, codec, x in (("K", cache.dense_k, cache.k_pages, fmt.k, s.k),
                                                 ("V", cache.dense_v, cache.v_pages, fmt.v, s.v)):
                buf, x = dense[layer][s.slot], x[layer]
                ns, nr = len(rule.sink), len(rule.recent)
                assert torch.equal(buf[:, :ns], x[:, rule.sink]), f"sink {name} of {where}"
                assert torch.equal(buf[:, S:S + nr], x[:, rule.recent]), f"recent {name} of {where}"
                for j, group in enumerate(rule.pages):
                    pid = int(cache.page_table[s.slot, j])
                    page = codec.decode({f: t[pid] for f, t in pages[layer].items()})
                    assert torch.equal(page, codec.decode(codec.encode(x[:, group]))), f"page {j} {name} of {where}"


def interesting_lengths(S: int, R: int) -> list[int]:
    lengths = [0, 1, S - 1, S, S + R - 1, S + R, S + R + 127, S + R + 128, S + R + 129, S + R + 3 * PAGE_TOKENS + 1]
    return sorted({n for n in lengths if n >= 0})


SINK_WINDOW = [(32, 128), (5, 3), (0, 0)]  # the defaults, small odd ones, and no sink / no window


# ---- tier boundaries -------------------------------------------------------------------------

@pytest.mark.parametrize("S,R", SINK_WINDOW)
def test_tier_boundaries_after_prefill(S, R):
    """One block of each interesting length lands in exactly the right tiers."""
    cache = make_cache(sink=S, window=R, max_seqs=1)
    for n in interesting_lengths(S, R):
        seq = Seq(cache, max(n, 1), seed=n)
        if n:
            feed(cache, [seq], n)
        check_tiers(cache, [seq])
        cache.release(seq.slot)  # the next sequence reuses the slot and pages over stale data


@pytest.mark.parametrize("S,R", SINK_WINDOW)
def test_tier_boundaries_during_decode(S, R):
    """Token by token from an empty slot through three flushes, checked after every step."""
    cache = make_cache(sink=S, window=R, max_seqs=1)
    n = S + R + 3 * PAGE_TOKENS + 2
    seq = Seq(cache, n, seed=1)
    for _ in range(n):
        feed(cache, [seq], 1)
        check_tiers(cache, [seq])
    assert len(seq.rule.pages) == 3


@pytest.mark.parametrize("S,R", SINK_WINDOW)
def test_tier_boundaries_prefill_then_batched_decode(S, R):
    """Sequences prefilled to every interesting length, then decoded together as one batch (so
    rows flush at different steps), then fed odd-sized blocks together; checked after every step."""
    lengths = interesting_lengths(S, R)
    cache = make_cache(sink=S, window=R, max_seqs=len(lengths))
    decode_steps, blocks = PAGE_TOKENS + 2, (129, 2)  # every row crosses one flush, then blocks straddle pages
    seqs = [Seq(cache, n + decode_steps + sum(blocks), seed=n) for n in lengths]
    for seq, n in zip(seqs, lengths):
        if n:
            feed(cache, [seq], n)
    check_tiers(cache, seqs)
    for _ in range(decode_steps):
        feed(cache, seqs, 1)
        check_tiers(cache, seqs)
    for n_new in blocks:  # blocks after decode: chunked prefill / KVarN's pseudo-decode
        feed(cache, seqs, n_new)
        check_tiers(cache, seqs)


def test_tier_boundaries_chunked_prefill():
    """A prompt arriving in blocks that straddle every boundary ends where the rule says."""
    S, R = 32, 128
    cache = make_cache(sink=S, window=R, max_seqs=1)
    blocks = [S - 1, 2, R - 2, 1, 127, 129, 1, 1, 300, 1]
    seq = Seq(cache, sum(blocks), seed=2)
    for n in blocks:
        feed(cache, [seq], n)
        check_tiers(cache, [seq])
    assert len(seq.rule.pages) == (sum(blocks) - S - R) // PAGE_TOKENS


# ---- the flush -------------------------------------------------------------------------------

def test_flush_every_128_decode_steps(monkeypatch):
    """Pages are encoded exactly when a row's recent tier reaches R + 128 tokens: once every 128
    decode steps, one tile per flushing row, into the row's next reserved page, for K and V of
    every layer; and no page changes at any other time (so Kitty ranks a page once, at its flush)."""
    S, R, prompts, steps = 4, 8, (50, 100), 3 * PAGE_TOKENS + 10
    writes = []  # (decode step, tiles a layer, page ids) of every encode_pages call
    real_encode = kernels.encode_pages

    def counting_encode(codec, x, pool_fields, page_ids, backend=None, query_weight=None, rows=None):
        # a flush encodes every layer in one call, into the layers' fields seen as [layers x pages, ...]
        layer, page = page_ids.cpu() // cache.pool.num_pages, page_ids.cpu() % cache.pool.num_pages
        assert sorted(layer.tolist()) == sorted(list(range(LAYERS)) * (len(page_ids) // LAYERS)), "every layer, once"
        writes.append((step, len(page_ids) // LAYERS, sorted(set(page.tolist()))))
        real_encode(codec, x, pool_fields, page_ids, backend, query_weight, rows)

    monkeypatch.setattr(kernels, "encode_pages", counting_encode)
    cache = make_cache("kitty", sink=S, window=R, budget_mib=1)  # a small pool: it is compared every step
    seqs = [Seq(cache, n + steps, seed=n) for n in prompts]
    step = 0
    for seq, n in zip(seqs, prompts):
        feed(cache, [seq], n)
    assert writes == [], "prompts this short fill no page"
    fields = [f for layer in range(LAYERS) for f in (*cache.k_pages[layer].values(), *cache.v_pages[layer].values())]
    for step in range(1, steps + 1):
        before = [f.clone() for f in fields]
        feed(cache, seqs, 1)
        written = {p for w in writes if w[0] == step for p in w[2]}
        for old, new in zip(before, fields):
            changed = set((old != new).flatten(1).any(1).nonzero().flatten().tolist())
            assert changed <= written, f"decode step {step}: pages {changed - written} changed outside a flush"

    assert all(n_tiles == 1 for _, n_tiles, _ in writes), "only the row whose recent tier is full is encoded"
    for seq, n in zip(seqs, prompts):
        reserved = cache.page_table[seq.slot, :3].tolist()
        mine = [w for w in writes if w[2][0] in reserved]
        first = S + R + PAGE_TOKENS - n  # the decode step after which the length is S + R + 128
        flushes = sorted({w[0] for w in mine})
        assert flushes == [first, first + PAGE_TOKENS, first + 2 * PAGE_TOKENS], f"prompt of {n}: flushes after decode steps {flushes}"
        # K and V (of every layer, checked as they were written) at each flush, into the reserved pages in order
        assert [w[2] for w in mine] == [[p] for p in reserved for _ in range(2)]


# ---- attention over the tiers ----------------------------------------------------------------

@pytest.mark.parametrize("kv", ["fp16", *QUANT_METHODS])
def test_attention_over_tiers_matches_direct_softmax(kv):
    """Every attention output of a mixed workload (prefill, batched decode through a flush, a
    batched block over rows of different lengths) equals a float64 softmax over [sink | round
    trip of each page with quant/ | recent]. For fp16 that is plain attention over K/V with
    exactly the paged tokens rounded to fp16 (the fp32 sink and recent keep full precision)."""
    cache = make_cache(kv, sink=4, window=8, max_seqs=2)
    fmt, memo = cache.formats[0], {}
    a, b = Seq(cache, 450, seed=3), Seq(cache, 450, seed=4)
    feed(cache, [a], 150, fmt, memo)  # one page written by the prefill
    feed(cache, [b], 3, fmt, memo)  # still inside the sink
    for _ in range(140):  # a flushes its second page at length 268
        feed(cache, [a, b], 1, fmt, memo)
    feed(cache, [a, b], 130, fmt, memo)  # a block over stored pages, for rows of different lengths
    for _ in range(3):
        feed(cache, [a, b], 1, fmt, memo)
    assert [len(s.rule.pages) for s in (a, b)] == [3, 2]


def test_decode_table_width_holds_the_longest_row():
    """A decode step's attention sees the least 2^k - 1 columns (at least 31) of the page table that
    hold the step's longest row, capped at the table, whichever row that is; worked by hand for
    sink 4 and window 8, where a row holds n pages from 12 + 128 n tokens. A graph capture, on
    scratch rows, gets the width it is given."""
    cache = KVCache(quant.get_format("kitty"), n_layers=LAYERS, n_kv_heads=H, head_dim=D, sink=4, window=8,
                    max_seqs=3, max_seq_len=100 * PAGE_TOKENS + 12, num_pages=400)
    assert cache.page_table.shape[1] == 100

    def width_seen() -> int:  # the page table's width in the attention's tiers
        return cache._tiers(0, StepCounts(*cache._step.counts[0])).page_table.shape[1]

    slots = [cache.admit(100 * PAGE_TOKENS + 12) for _ in range(3)]
    for tokens, want in ((0, 31), (12 + PAGE_TOKENS, 31), (12 + 32 * PAGE_TOKENS - 1, 31), (12 + 32 * PAGE_TOKENS, 63),
                         (12 + 63 * PAGE_TOKENS, 63), (12 + 64 * PAGE_TOKENS, 100), (12 + 99 * PAGE_TOKENS, 100)):
        cache.assume_stored(slots[0], tokens)
        cache.assume_stored(slots[1], max(tokens - 5 * PAGE_TOKENS, 0))
        for rows in (slots[:2], slots[1::-1]):
            assert cache.decode_table_pages(rows) == want, f"longest row {tokens} tokens, rows {rows}"
            cache.prepare_step(rows, 1)
            assert width_seen() == want
    assert cache.decode_table_pages(slots[1:]) == 100  # slot 1's 94 pages (slot 2 is empty): 127, capped
    assert cache.decode_table_pages(slots[2:]) == 31
    cache.prepare_step([], 1, rows=2, table_pages=63)
    assert width_seen() == 63


def test_decode_over_more_pages_than_the_narrowest_table_matches_direct_softmax():
    """Rows of 33 and 2 pages in a cache whose table holds 1024: a decode step's attention (given 63
    columns) equals the float64 softmax over every page of both rows."""
    cache = KVCache(quant.get_format("kivi-k2v2"), n_layers=LAYERS, n_kv_heads=H, head_dim=D, sink=4, window=8,
                    max_seqs=2, max_seq_len=1024 * PAGE_TOKENS, num_pages=40)
    fmt, memo = cache.formats[0], {}
    a, b = Seq(cache, 33 * PAGE_TOKENS + 12 + 2, seed=5), Seq(cache, 2 * PAGE_TOKENS + 12 + 2, seed=6)
    feed(cache, [a], 33 * PAGE_TOKENS + 12, fmt, memo)
    feed(cache, [b], 2 * PAGE_TOKENS + 12, fmt, memo)
    assert cache.decode_table_pages([a.slot, b.slot]) == 63
    for _ in range(2):
        feed(cache, [a, b], 1, fmt, memo)
    assert [len(s.rule.pages) for s in (a, b)] == [33, 2]


def test_attention_check_can_fail():
    """The check in feed is sharp: a kivi-k2v2 cache fails it against the fp16 oracle."""
    cache = make_cache("kivi-k2v2", sink=4, window=8, max_seqs=1)
    seq = Seq(cache, 151, seed=5)
    feed(cache, [seq], 150)  # writes one page
    with pytest.raises(AssertionError, match="not close"):
        feed(cache, [seq], 1, quant.get_format("fp16"), {})


# ---- through a model: teacher-forced logits --------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    make_tiny_model("llama", folder)  # GQA: 4 q heads, 2 kv heads, head dim 16
    return folder


def make_llm(folder: Path, **kw) -> LLM:
    return LLM(str(folder), device="cpu", progress=False, kv_budget_gb=0.05, **kw)


def teacher_forced(model, cache, ids: torch.Tensor, schedule: list[int]) -> torch.Tensor:
    """Logits [N, V] of ids [1, N] fed as slot 0 of `cache` (an oracle, or a KVCache that admitted
    them there) in blocks of the schedule's sizes (1 = a decode step); LLM.teacher_force does the
    same through an LLM's own cache."""
    out, pos = [], 0
    with torch.no_grad():
        for n in schedule:
            cache.begin_step([0], n)
            out.append(model(ids[:, pos:pos + n], torch.arange(pos, pos + n)[None], cache=cache)[0])
            cache.end_step()
            pos += n
    return torch.cat(out)


def tap_kv(monkeypatch, cache: KVCache, on_kv) -> None:
    """Make the cache pass each layer's new (k, v) through on_kv(layer, k, v) before storing them
    (k rotated, as the cache stores it: the rotation the cache would apply is applied here first)."""
    attend = cache.attend

    def tapped(layer, q, k, v, rope=None):
        if rope is not None:
            q, k = kernels.apply_rope(q, *rope), kernels.apply_rope(k, *rope)
        return attend(layer, q, *on_kv(layer, k, v))

    monkeypatch.setattr(cache, "attend", tapped)


# prefill (page 0 with sink 4, window 8), decode through the flush of page 1 at 268, a block, decode
SCHEDULE = [150] + [1] * 120 + [30] + [1] * 30


def fp16_round(x: torch.Tensor) -> torch.Tensor:
    return x.half().to(x.dtype)


def test_fp16_tiers_logits_equal_plain_attention(tiny_llama, monkeypatch):
    """FP16 tiers (sink 4, window 8: most tokens in pages, prefilled and flushed by decode) give
    the logits of plain causal SDPA over the same fp16-rounded K/V, within fp32 op-order noise
    (LOGIT_ATOL): the fp16 pages lose nothing on fp16-exact K/V."""
    llm = make_llm(tiny_llama, sink=4, window=8)
    ids = torch.randint(0, 256, (1, sum(SCHEDULE)), generator=torch.Generator().manual_seed(6))
    # The cache gets fp16-rounded K/V, so its fp32 tiers hold exactly the values the oracle uses.
    tap_kv(monkeypatch, llm.cache, lambda layer, k, v: (fp16_round(k), fp16_round(v)))
    assert llm.cache.admit(ids.shape[1]) == 0  # kept afterwards: its pages are counted below
    ours = teacher_forced(llm.model, llm.cache, ids, SCHEDULE)
    plain_attention = kernels.causal_attention
    monkeypatch.setattr(kernels, "causal_attention",
                        lambda q, k, v, window=None: plain_attention(q, fp16_round(k), fp16_round(v), window))
    with torch.no_grad():
        plain = llm.model(ids)[0]
    torch.testing.assert_close(ours, plain, atol=LOGIT_ATOL, rtol=0)
    assert llm.kv_stats()["pages"] == 2 * llm.cache.shape.page_bytes()


@pytest.mark.parametrize("kv", QUANT_METHODS)
def test_teacher_forced_quantized_logits_equal_direct_oracle(tiny_llama, kv):
    """Teacher-forced decoding with a quantized method through the real cache gives the logits
    of the same model run on DirectTiers (quant/ round trip of each page + plain softmax)."""
    sink, window = 4, 8
    llm = make_llm(tiny_llama, kv=kv, sink=sink, window=window)
    ids = torch.randint(0, 256, (1, sum(SCHEDULE)), generator=torch.Generator().manual_seed(7))
    ours = llm.teacher_force(ids[0].tolist(), SCHEDULE)
    oracle = DirectTiers(quant.get_format(kv), sink, window, llm.model.config.n_layers)
    expected = teacher_forced(llm.model, oracle, ids, SCHEDULE)
    assert len(oracle.rule.pages) == 2
    torch.testing.assert_close(ours, expected, atol=LOGIT_ATOL, rtol=0)
    with torch.no_grad():  # and the comparison can tell: quantization moves the logits far more
        exact = llm.model(ids)[0]
    assert (ours - exact).abs().max() > 100 * LOGIT_ATOL


# ---- Kitty on real keys ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    return loading.load_model(None, device="cpu", progress=False)


def test_kitty_ranking_changes_page_to_page_on_real_keys(smollm2, monkeypatch):
    """On SmolLM2's real post-RoPE keys of English text, the boosted channels Kitty stores for a
    page are the top mean-|K| channels of exactly that page's 128 tokens, and they differ from
    page to page: the ranking is per page, not fixed per head."""
    model, tokenizer = smollm2
    S, R = 32, 16
    text = (Path(quant.__file__).parent / "sample.txt").read_text()
    n = S + R + 3 * PAGE_TOKENS
    ids = torch.tensor([tokenizer.encode(text)[:n]])
    assert ids.shape[1] == n
    llm = LLM(*smollm2, kv="kitty", sink=S, window=R, max_batch=1, kv_budget_gb=0.1, device="cpu")
    cache = llm.cache
    keys_seen: dict[int, list[torch.Tensor]] = {}  # the post-RoPE keys each layer hands the cache

    def record(layer, k, v):
        keys_seen.setdefault(layer, []).append(k[0])
        return k, v

    slot = cache.admit(n)
    assert slot == 0
    tap_kv(monkeypatch, cache, record)
    # The prefill writes pages 0 and 1; the last decode step flushes page 2 (the online ranking).
    teacher_forced(model, cache, ids, [n - 32] + [1] * 32)
    nb = cache.formats[0].k.n_boost(model.config.head_dim)
    changing = []
    for layer in range(model.config.n_layers):
        keys = torch.cat(keys_seen[layer], dim=1)  # [H, n, hd]
        boosted = []
        for j in range(3):
            stored = cache.k_pages[layer]["ids"][int(cache.page_table[slot, j])].long()
            top = keys[:, S + PAGE_TOKENS * j:S + PAGE_TOKENS * (j + 1)].abs().mean(1).topk(nb).indices
            for h in range(keys.shape[0]):
                assert set(stored[h].tolist()) == set(top[h].tolist()), f"layer {layer} head {h} page {j}"
            boosted.append(stored)
        changing += [len({frozenset(p[h].tolist()) for p in boosted}) > 1 for h in range(keys.shape[0])]
    # Measured: the boosted set changes between the 3 pages in all 90 (layer, kv head) pairs.
    assert sum(changing) > len(changing) // 2, f"boosted channels vary in only {sum(changing)} of {len(changing)} heads"


# ---- the pool after a run ----------------------------------------------------------------------

def test_pool_holds_every_page_after_a_run(tiny_llama):
    """A continuously batched run (more prompts than slots, pages written by prefill and by
    decode flushes, one request cancelled midway) gives every page and slot back."""
    llm = make_llm(tiny_llama, kv="kitty", sink=4, window=8, max_batch=2)
    cache, pool = llm.cache, llm.cache.pool
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 140, 300, 20, 150)]
    reqs = [llm.add_request(p, SamplingParams(max_new_tokens=150, ignore_eos=True)) for p in prompts]
    fewest_free = pool.num_pages
    while llm.has_work():
        llm.step()
        fewest_free = min(fewest_free, pool.num_free)
        if len(reqs[1].output_ids) == 40 and not reqs[1].finished:
            llm.cancel(reqs[1])
    assert reqs[1].finish_reason == "cancelled"
    assert all(r.finish_reason == "length" for i, r in enumerate(reqs) if i != 1)
    assert fewest_free <= pool.num_pages - 4, "the run held the pages of two sequences at once"
    assert pool.num_free == pool.num_pages
    assert sorted(pool.allocate(pool.num_pages)) == list(range(pool.num_pages)), "every page exactly once"
    assert cache.num_free_slots == 2
    assert llm.cache.kv_stats()["total"] == 0


def test_kvmix_layers_keep_their_share_of_the_context_in_fp16():
    """KVmix's recent pivotal context: a layer keeps max(window, ratio x length) of its newest
    tokens in full precision, so the window grows with the sequence. Through a prefill, chunks
    and decode steps, every layer's tiers, buffers and attention output equal its own rule's;
    the full-precision share stays at least each ratio; kv_stats counts it. Each layer's buffer is
    as long as its own window gets (sink + 10% or 25% of max_seq_len + a page), and the cache
    allocates what CacheShape.slot_bytes sizes its budget by."""
    plan = {"method": "kvmix", "layers": [{"k_bits": 2, "v_bits": 2, "window_ratio": 0.1},
                                          {"k_bits": 4, "v_bits": 4, "window_ratio": 0.25}]}
    fmt = quant.get_format("kvmix", plan=plan)
    n = 4 + 900
    cache = KVCache(fmt, n_layers=LAYERS, n_kv_heads=H, head_dim=D, sink=4, window=8, max_seqs=1, max_seq_len=n,
                    budget_bytes=8 * 2**20)
    assert [cache.dense_k[layer].shape[2] for layer in range(LAYERS)] == [4 + n // 10 + 128, 4 + n // 4 + 128]
    allocated = sum(t.numel() * t.element_size() for t in cache._dense.values())
    token_bytes = 2 * H * D * cache.dtype.itemsize  # K and V
    # the slot and the scratch slot, each: per layer a sink and a page, and the layer's share
    assert allocated == 2 * cache.shape.slot_bytes() == 2 * token_bytes * (2 * (4 + 128) + n // 10 + n // 4)
    seq, memo = Seq(cache, n, seed=12), {}
    for size in [300, 1, 1, 250] + [1] * 352:
        feed(cache, [seq], size, fmt=fmt, memo=memo)
        check_tiers(cache, [seq])
    low, high = cache.kv_stats()["layers"]
    assert len(seq.rules[0].pages) > len(seq.rules[1].pages) > 0
    assert low["recent"] >= 0.1 * n * token_bytes and high["recent"] >= 0.25 * n * token_bytes
    assert high["pages"] == len(seq.rules[1].pages) * quant.get_format("kivi-k4v4").page_bytes(H, D)


def test_kvmix_flush_takes_each_layer_from_its_windows_buffer(monkeypatch):
    """KVmix plans mix bits and window ratios freely, so one codec's layers can sit in two windows,
    whose FP16 buffers differ in length. A flush encodes each layer's oldest recent tokens from its
    window's buffer into its codec's fields: through a prefill of two rows, one row decoding alone
    past a flush, then both, every tier of every layer holds what its rule says."""
    monkeypatch.setattr(sys.modules[__name__], "LAYERS", 4)
    plan = {"method": "kvmix", "layers": [{"k_bits": 2, "v_bits": 2, "window_ratio": 0.1},
                                          {"k_bits": 2, "v_bits": 2, "window_ratio": 0.25},
                                          {"k_bits": 4, "v_bits": 2, "window_ratio": 0.1},
                                          {"k_bits": 2, "v_bits": 4, "window_ratio": 0.25}]}
    n = 4 + 900
    cache = KVCache(quant.get_format("kvmix", plan=plan), n_layers=4, n_kv_heads=H, head_dim=D, sink=4, window=8,
                    max_seqs=3, max_seq_len=n, budget_bytes=16 * 2**20)
    seqs = [Seq(cache, n, seed=20 + i) for i in range(2)]
    feed(cache, seqs, 300)
    check_tiers(cache, seqs)
    for _ in range(200):
        feed(cache, [seqs[1]], 1)
    check_tiers(cache, seqs)
    for _ in range(150):
        feed(cache, seqs[::-1], 1)
    check_tiers(cache, seqs)
    assert [len(rule.pages) for rule in seqs[1].rules] == [4, 3, 4, 3], "the decode flushed pages in every layer"


def test_recent_view_holds_the_recent_tier_of_every_row_the_width_serves():
    """A step's tiers give each layer's recent tier a view as long as the rows its table width
    serves can need, so that the attention splits a long tier (KVmix's, a share of the context)
    over more programs: at least, and within a page's growth of the window of, the most recent
    tokens a decode step's counts (what the attention reads) hold, found by trying every length
    whose pages fit the width. A fixed window stays at window + 128 at every width."""
    from kvcache.cache import _step_counts

    ratios = (0.1, 0.25)
    plan = {"method": "kvmix", "layers": [{"k_bits": 2, "v_bits": 2, "window_ratio": r} for r in ratios]}
    n = 200 * PAGE_TOKENS
    cache = KVCache(quant.get_format("kvmix", plan=plan), n_layers=LAYERS, n_kv_heads=H, head_dim=D, sink=4, window=8,
                    max_seqs=1, max_seq_len=n, num_pages=1)
    stored = torch.arange(n)  # a decode step's row has stored < n tokens
    pages = torch.stack([(stored - 4 - w.tokens_t(stored)).clamp(min=0) // PAGE_TOKENS for w in cache.windows])
    pages = pages.max(0).values  # the layer with the shortest window holds the most
    for width in (31, 63, 127, cache.page_table.shape[1]):
        cache.prepare_step([], 1, rows=1, table_pages=width)
        for layer, ratio in enumerate(ratios):
            most = int(_step_counts(stored, 4, cache.windows[layer], 1)[3][pages <= width].max())
            seen = cache._tiers(layer, StepCounts(*cache._step.counts[0])).recent_k.shape[2]  # (any counts)
            assert most <= seen <= most + ratio * PAGE_TOKENS, f"width {width}, layer {layer}: {seen} for {most}"
    fixed = KVCache(quant.get_format("kitty"), n_layers=LAYERS, n_kv_heads=H, head_dim=D, sink=4, window=8,
                    max_seqs=1, max_seq_len=n, num_pages=1)
    assert {fixed.recent_view_tokens(w) for w in (31, 63, fixed.page_table.shape[1])} == {(8 + PAGE_TOKENS,) * LAYERS}


def test_kitty_q_aware_boosts_the_channels_the_queries_weigh():
    """kitty:score=q-aware ranks a page's key channels by range x the mean |q| the cache keeps per
    sequence and kv head: queries that lean on one channel (a different one per sequence) get it
    boosted in every page of that sequence, prefilled or decoded, though keys alone would not pick it."""
    cache = make_cache("kitty:score=q-aware", sink=4, window=8, max_seqs=2)
    seqs = [Seq(cache, 4 + 8 + 3 * PAGE_TOKENS, seed=s) for s in (1, 2)]
    for seq, channel in zip(seqs, (3, 11)):
        seq.q[..., channel] *= 100
        seq.k[..., 0] *= 5  # the widest key channel: what magnitude or range would boost
    for seq in seqs:
        feed(cache, [seq], 4 + 8 + PAGE_TOKENS + 40)  # one page from the prefill
    for _ in range(2 * PAGE_TOKENS - 40):  # two more from decode steps
        feed(cache, seqs, 1)
    for seq, channel in zip(seqs, (3, 11)):
        pages = cache.page_table[seq.slot, :3].long()
        assert len(seq.rule.pages) == 3
        for layer in range(LAYERS):
            assert (cache.k_pages[layer]["ids"][pages, :, 0] == channel).all(), (layer, channel)
