"""The model and the decode loop against HF transformers, on tiny random models of every family.

Oracle: transformers' own forward and greedy generate (fp32, CPU) on the same saved weights;
for the text of the tokens, the tokenizer's own decode of all of them at once.
NANOKV_TEST_DEVICE=cuda runs our side on the GPU in fp16 with the Triton kernels.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

import loading
from llm import LLM, Request
from sampling import SamplingParams
from tests.tiny_models import FAMILIES, byte_level_tokenizer, make_tiny_model
from tokenizer import Tokenizer

DEVICE = os.environ.get("NANOKV_TEST_DEVICE", "cpu")
DTYPE = torch.float32 if DEVICE == "cpu" else torch.float16
# fp32 on CPU: the same math in another op order. fp16 on CUDA: logits of magnitude ~5 carry
# ~3e-3 rounding each, accumulated over two layers.
LOGIT_ATOL = 1e-4 if DEVICE == "cpu" else 3e-2
PAGE_ATOL = 2e-3 if DEVICE == "cpu" else 3e-2  # fp16 pages in an fp32 model on CPU


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model(request.param, folder)
    return request.param, folder, hf


def make_llm(folder, **kw) -> LLM:
    kw.setdefault("kv_budget_gb", 0.05)
    kw.setdefault("max_batch", 4)
    return LLM(str(folder), device=DEVICE, dtype=DTYPE, progress=False, **kw)


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def assert_same_greedy(hf, prompt: list[int], ours: list[int]) -> None:
    """Our greedy tokens equal HF's; on fp16 a different token is only allowed where HF's own
    top two logits are closer than the fp16 logit tolerance (a near tie), after which the
    two continuations legitimately differ."""
    ref = hf_greedy(hf, prompt, len(ours))
    if DEVICE == "cpu" or ours == ref:
        assert ours == ref
        return
    i = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ref[:i]])).logits[0, -1]
    margin = float(logits[ref[i]] - logits[ours[i]])
    assert margin < 2 * LOGIT_ATOL, f"token {i}: ours {ours[i]} vs HF {ref[i]}, HF margin {margin:.4f}"


def test_prefill_logits_match_hf(family_model):
    family, folder, hf = family_model
    model, _ = loading.load_model(str(folder), device=DEVICE, dtype=DTYPE, progress=False)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, ref = model(ids.to(DEVICE)).float().cpu(), hf(ids).logits
    torch.testing.assert_close(ours, ref, atol=LOGIT_ATOL, rtol=0)


def test_greedy_tokens_match_hf(family_model):
    family, folder, hf = family_model
    llm = make_llm(folder)
    prompt = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    [req] = llm.generate([prompt], SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert_same_greedy(hf, prompt, req.output_ids)


def test_decode_through_pages_matches_hf(family_model):
    """A tiny sink and window push most of the context through fp16 pages and many flushes;
    every position's logits must match HF's full forward up to fp16 rounding of the pages."""
    family, folder, hf = family_model
    llm = make_llm(folder, sink=4, window=8)
    ids = torch.randint(0, 256, (1, 330), generator=torch.Generator().manual_seed(3))
    ours = llm.teacher_force(ids[0].tolist(), [150] + [1] * 180).float().cpu()  # a prefill, then decode steps
    with torch.no_grad():
        ref = hf(ids).logits[0]
    torch.testing.assert_close(ours[:150], ref[:150], atol=LOGIT_ATOL, rtol=0)
    torch.testing.assert_close(ours[150:], ref[150:], atol=PAGE_ATOL, rtol=0)
    assert llm.cache.pool.num_free == llm.cache.pool.num_pages


def test_chunked_prefill_matches_hf(family_model):
    """A prompt prefilled 16 tokens a step (each chunk attending to the chunks before it) gives
    HF's greedy tokens; with a tiny sink and window the chunks also pass through pages."""
    family, folder, hf = family_model
    prompt = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(6)).tolist()
    [req] = make_llm(folder, prefill_chunk=16).generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert_same_greedy(hf, prompt, req.output_ids)
    ids = torch.randint(0, 256, (1, 320), generator=torch.Generator().manual_seed(7))
    ours = make_llm(folder, sink=4, window=8).teacher_force(ids[0].tolist(), [64] * 5).float().cpu()
    with torch.no_grad():
        ref = hf(ids).logits[0]
    torch.testing.assert_close(ours[:64], ref[:64], atol=LOGIT_ATOL, rtol=0)
    torch.testing.assert_close(ours, ref, atol=PAGE_ATOL, rtol=0)


def test_a_long_prompt_is_prefilled_between_decode_steps(tmp_path):
    """While a long prompt arrives in chunks, the running sequences advance a token every step;
    every result equals the same request run alone."""
    make_tiny_model("llama", tmp_path)
    llm = make_llm(tmp_path, prefill_chunk=32, sink=4, window=8)
    g = torch.Generator().manual_seed(8)
    short = [torch.randint(0, 256, (10,), generator=g).tolist() for _ in range(2)]
    long = torch.randint(0, 256, (200,), generator=g).tolist()
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    alone = [llm.generate([p], params)[0].output_ids for p in (*short, long)]
    running = [llm.add_request(p, params) for p in short]
    llm.step()
    late = llm.add_request(long, params)
    before = [r.n_sampled for r in running]
    for chunk in range(1, 7):  # 200 tokens in chunks of 32: the seventh step holds the last 8
        llm.step()
        assert late.n_prefilled == 32 * chunk and not late.n_sampled
        assert [r.n_sampled for r in running] == [n + chunk for n in before]
    llm.step()
    assert late.n_prefilled == 200 and late.n_sampled == 2  # sampled after its last chunk, then decoded
    llm.run([])
    assert [r.output_ids for r in (*running, late)] == alone
    assert llm.cache.pool.num_free == llm.cache.pool.num_pages


def test_batched_equals_unbatched():
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        make_tiny_model("llama", Path(d))
        llm = make_llm(d, max_batch=3, sink=4, window=8)
        g = torch.Generator().manual_seed(4)
        prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 37, 130, 300)]
        params = SamplingParams(max_new_tokens=20, ignore_eos=True)
        alone = [llm.generate([p], params)[0].output_ids for p in prompts]
        together = [r.output_ids for r in llm.generate(prompts, params)]  # 4 prompts, 3 slots: one waits
        assert together == alone
        assert llm.cache.pool.num_free == llm.cache.pool.num_pages
        assert llm.cache.num_free_slots == 3


@pytest.mark.skipif(DEVICE == "cpu", reason="CUDA graphs need a GPU (NANOKV_TEST_DEVICE=cuda)")
def test_decode_graphs_follow_the_longest_row(tmp_path):
    """A model of 16k positions: the decode graphs are captured per page-table width, and a row
    that grows from 31 to 32 pages mid-decode (sink 4, window 8: at 12 + 32 * 128 tokens) moves
    the step to a graph of 63 columns; the tokens equal those of eager decode steps."""
    make_tiny_model("llama", tmp_path, config={"max_position_embeddings": 16384})
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (4090, 60)]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    outs = {}
    for graphs in (True, False):
        llm = make_llm(tmp_path, kv="kitty", sink=4, window=8, max_batch=2, cuda_graphs=graphs)
        outs[graphs] = [r.output_ids for r in llm.generate(prompts, params)]
        if graphs:
            assert {key.table_pages for key in llm.runner.graphs.graphs} == {31, 63}
    assert outs[True] == outs[False]


def test_requests_wait_when_pages_run_out(tmp_path):
    """A pool that holds one long sequence at a time queues the others; results are unchanged."""
    make_tiny_model("qwen2", tmp_path)
    roomy = make_llm(tmp_path, sink=4, window=8)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (200,), generator=g).tolist() for _ in range(3)]
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    expected = [r.output_ids for r in roomy.generate(prompts, params)]

    tight = make_llm(tmp_path, sink=4, window=8)
    per_seq = tight.cache.pages_needed(260)
    tight.cache.pool = type(tight.cache.pool)(per_seq)  # room for exactly one sequence's pages
    reqs = [tight.add_request(p, params) for p in prompts]
    tight.step()
    assert len(tight.running) == 1 and len(tight.waiting) == 2
    while tight.has_work():
        tight.step()
    assert [r.output_ids for r in reqs] == expected
    assert tight.cache.pool.num_free == per_seq


def test_sampling_is_seeded_and_respects_top_k(tmp_path):
    make_tiny_model("llama", tmp_path)
    llm = make_llm(tmp_path)
    prompt = list(range(10))
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=3, seed=7)
    a = llm.generate([prompt], params)[0].output_ids
    b = llm.generate([prompt], params)[0].output_ids
    assert a == b
    # top_k=1 sampling is greedy whatever the temperature
    greedy = llm.generate([prompt], SamplingParams(max_new_tokens=12))[0].output_ids
    assert llm.generate([prompt], SamplingParams(max_new_tokens=12, temperature=2.0, top_k=1, seed=1))[0].output_ids == greedy


def test_bad_requests_get_clear_errors(tmp_path):
    make_tiny_model("opt", tmp_path)
    llm = make_llm(tmp_path)
    with pytest.raises(ValueError, match="empty"):
        llm.add_request([])
    with pytest.raises(ValueError, match="context is 512"):
        llm.add_request(list(range(600)))
    with pytest.raises(ValueError, match="kivi-k2v2"):
        make_llm(tmp_path, kv="kivi-2bit")


@pytest.mark.parametrize("kv", ["fp16", "kitty", "nqkv"])
def test_triton_kernels_give_the_torch_paths_tokens(tmp_path, kv):
    """With the Triton kernels forced (interpreted on CPU), greedy decoding through pages gives
    the same tokens as the torch reference path; the 130-token prompt's recent tier fills at its
    10th decode step, so a flush encodes a page (every layer at once) while the other row does not."""
    make_tiny_model("llama", tmp_path)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (40, 130)]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = make_llm(tmp_path, kv=kv, sink=4, window=8, backend=backend)
        outs[backend] = [r.output_ids for r in llm.generate(prompts, params)]
    assert outs["triton"] == outs["torch"]


class LetterTokenizer:
    """Token i reads as one letter, so stop strings can be put anywhere in a token stream."""

    eos_ids: set[int] = set()

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_eos_and_stop_strings_end_requests_without_disturbing_the_batch(tmp_path):
    """The host reads each step's tokens one step late, so a finished request computes one token
    too many. That token must not show up, its pages must come back, and the requests decoding
    beside it, or taking its slot, must produce what they produce alone."""
    make_tiny_model("llama", tmp_path)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (20, 45, 140)]
    free_run = SamplingParams(max_new_tokens=40, ignore_eos=True)
    llm = make_llm(tmp_path, max_batch=2, sink=4, window=8)
    llm.tokenizer = LetterTokenizer()
    alone = [llm.generate([p], free_run)[0].output_ids for p in prompts]

    eos = alone[0][10]  # request 0 ends at the first occurrence of its 11th token
    cut = alone[0].index(eos)
    llm.eos_ids = {eos}
    stop = LetterTokenizer().decode(alone[1][12:14])  # request 1 stops at two letters it emits
    text1 = LetterTokenizer().decode(alone[1])
    reqs = [llm.add_request(prompts[0], SamplingParams(max_new_tokens=40)),
            llm.add_request(prompts[1], SamplingParams(max_new_tokens=40, ignore_eos=True, stop=[stop])),
            llm.add_request(prompts[2], free_run)]  # waits for a slot, then takes a freed one
    llm.run(reqs)
    assert reqs[0].finish_reason == "eos" and reqs[0].output_ids == alone[0][:cut]
    assert reqs[1].finish_reason == "stop" and reqs[1].text == text1[: text1.index(stop)]
    assert reqs[2].finish_reason == "length" and reqs[2].output_ids == alone[2]
    assert llm.cache.pool.num_free == llm.cache.pool.num_pages
    assert llm.cache.num_free_slots == 2


# ---- detokenization: text is decoded incrementally, token by token -------------------------------

SAMPLE = "héllo{special} wörld 日本語 🙂 👍🏽\n"  # 2-, 3- and 4-byte characters and a modifier
# Pieces of random texts: characters that come as several byte tokens, spaces, words, and special
# tokens (skipped in the text; each kind of tokenizer has one of them, the others are plain text).
PIECES = [*"ab xyz\n  éö日本語🙂👍🏽☃", "<s>", "</s>", "<|im_start|>", " the", "ing"]
TOKENIZER_KINDS = {  # kind: the special token it skips in SAMPLE
    "smollm2-gguf": "<|im_start|>",  # byte-level BPE (tokenizers), the default model's
    "byte-level": "",  # one token per byte (the tiny models'): every non-ASCII character is split
    "sentencepiece": "<s>",  # tokenizer.model: sentencepiece itself, with byte fallback
    "sentencepiece-gguf": "<s>",  # the same vocabulary from GGUF metadata: tokenizers' ByteFallback and Strip
}


@pytest.fixture(scope="module")
def text_llm(tmp_path_factory) -> LLM:
    """An LLM whose tokens the tests choose: they hand them to _accept as if sampled."""
    folder = tmp_path_factory.mktemp("text")
    make_tiny_model("llama", folder)
    return make_llm(folder)


def sentencepiece_model() -> bytes:
    """A small sentencepiece BPE vocabulary set up like Llama-2's (byte fallback, <s> and </s>)."""
    import inspect
    import io
    import textwrap

    import sentencepiece

    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(inspect.getsource(textwrap).splitlines()), model_writer=out, model_type="bpe",
        vocab_size=400, byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
    )
    return out.getvalue()


def gguf_metadata(spm: bytes) -> dict:
    """The GGUF tokenizer metadata ("llama" model) that llama.cpp writes for a sentencepiece vocabulary."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_proto=spm)
    n = sp.get_piece_size()
    kinds = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
            "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)], "tokenizer.ggml.token_type": kinds,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Tokenizer]:
    """Every kind of TOKENIZER_KINDS."""
    byte_level, spm = tmp_path_factory.mktemp("byte-level"), tmp_path_factory.mktemp("sentencepiece")
    byte_level_tokenizer().save(str(byte_level / "tokenizer.json"))
    model = sentencepiece_model()
    (spm / "tokenizer.model").write_bytes(model)
    (spm / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    return {"smollm2-gguf": loading.load_tokenizer(None), "byte-level": Tokenizer.from_folder(byte_level),
            "sentencepiece": Tokenizer.from_folder(spm),
            "sentencepiece-gguf": Tokenizer.from_gguf_metadata(gguf_metadata(model))}


def feed(llm: LLM, tokenizer, ids: list[int], **params) -> tuple[Request, list[str]]:
    """Hand `ids` to the engine one at a time as if sampled, until the request finishes (by default
    at the last id); returns the request and the chunks of text it streamed."""
    llm.tokenizer, llm.eos_ids = tokenizer, tokenizer.eos_ids
    params = SamplingParams(**{"max_new_tokens": len(ids), "ignore_eos": True, **params})
    chunks: list[str] = []
    req = Request(0, [0], params, on_text=lambda r, text: chunks.append(text))
    req.slot = llm.cache.admit(1)  # for _retire to give back: no step runs
    for token in ids:
        if req.finished:
            break
        llm._accept(req, token)
    assert req.finished
    return req, chunks


@pytest.mark.parametrize("kind", TOKENIZER_KINDS)
def test_streamed_text_is_the_full_decode(text_llm, tokenizers, kind):
    """Oracle: the tokenizer's own decode of all the output ids at once. The streamed chunks add up
    to the final text, and none holds half a character."""
    tok = tokenizers[kind]
    rng = random.Random(9)
    texts = [SAMPLE.format(special=TOKENIZER_KINDS[kind])]
    texts += ["".join(rng.choice(PIECES) for _ in range(rng.randrange(1, 25))) for _ in range(100)]
    for text in texts:
        ids = tok.encode(text, add_bos=False)
        req, chunks = feed(text_llm, tok, ids)
        assert req.text == "".join(chunks) == tok.decode(ids, skip_special=True), text
        assert not any("\ufffd" in chunk for chunk in chunks), text
    assert req.text  # the last random text decodes to something, lest this test pass on empty text


@pytest.mark.parametrize("kind", ["smollm2-gguf", "byte-level", "sentencepiece"])  # for ByteFallback: the next test
def test_half_characters_are_read_when_the_request_ends(text_llm, tokenizers, kind):
    """A request that ends (by EOS or its token limit) in the middle of a character, or holds a
    stray byte, gets the text the tokenizer makes of those bytes (U+FFFD) in full and in its stream."""
    tok = tokenizers[kind]
    emoji, kanji = tok.encode("🙂", add_bos=False), tok.encode("日", add_bos=False)
    broken = tok.encode("a", add_bos=False) + emoji[:-1] + tok.encode("b", add_bos=False) + kanji[:-1]
    req, chunks = feed(text_llm, tok, broken)
    assert req.finish_reason == "length"
    assert req.text == "".join(chunks) == tok.decode(broken, skip_special=True)
    assert req.text.endswith("\ufffd")
    if tok.eos_ids:
        req, chunks = feed(text_llm, tok, broken + [min(tok.eos_ids)], max_new_tokens=100, ignore_eos=False)
        assert req.finish_reason == "eos"
        assert req.text == "".join(chunks) == tok.decode(broken, skip_special=True)


def test_byte_fallback_keeps_streamed_text_on_an_invalid_byte(text_llm, tokenizers):
    """tokenizers' ByteFallback turns a whole run of byte tokens into U+FFFD when any of them is
    invalid, so a full decode would take back a character streamed before the bad byte came. The
    engine keeps it and reads the ids after it on their own."""
    tok = tokenizers["sentencepiece-gguf"]
    ids = tok.encode("x☃", add_bos=False) + [tok.backend.token_to_id("<0x80>")] + tok.encode("b", add_bos=False)
    assert tok.decode(ids, skip_special=True) == "x\ufffd\ufffd\ufffd\ufffd b"
    req, chunks = feed(text_llm, tok, ids)
    assert req.text == "".join(chunks) == "x☃\ufffd b"


@pytest.mark.parametrize("stops, expected", [
    (["lo wö"], "hél"),  # spans three tokens of SmolLM2 ('llo', ' w', 'ör')
    (["本語"], "héllo wörld 日"),  # completed by the last of 語's byte tokens
    (["ld", "wörld"], "héllo "),  # both complete at 'ld': the earlier one in the text wins
    (["🙂 x"], SAMPLE.format(special="")),  # its start is held back from the stream, then let go
])
@pytest.mark.parametrize("kind", ["smollm2-gguf", "byte-level"])
def test_stop_strings_across_tokens_are_cut(text_llm, tokenizers, kind, stops, expected):
    tok = tokenizers[kind]
    text = SAMPLE.format(special="")
    ids = tok.encode(text, add_bos=False)
    req, chunks = feed(text_llm, tok, ids, stop=stops)
    assert req.text == "".join(chunks) == expected  # nothing streamed was taken back
    # it ended at the token that completed a stop string
    prefixes = [tok.decode(ids[:n], skip_special=True) for n in range(len(ids) + 1)]
    assert len(req.output_ids) == next((n for n, t in enumerate(prefixes) if any(s in t for s in stops)), len(ids))
    assert req.finish_reason == ("length" if expected == text else "stop")


class CountingTokenizer:
    """A tokenizer that counts the ids it is asked to decode."""

    def __init__(self, tok: Tokenizer):
        self.tok, self.eos_ids, self.decoded = tok, tok.eos_ids, 0

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        self.decoded += len(ids)
        return self.tok.decode(ids, skip_special)


@pytest.mark.parametrize("kind", TOKENIZER_KINDS)
def test_decoding_work_per_token_does_not_grow_with_the_output(text_llm, tokenizers, kind):
    """Each token decodes a window of recent ids only, whatever the length of the output (~1000
    tokens here): the ids of the previous read (at most one character's byte tokens, 4) and those
    since (up to 4 while a character is incomplete), without and with the latter: 4 + 8 ids."""
    tok = tokenizers[kind]
    counting = CountingTokenizer(tok)
    text = SAMPLE.format(special=TOKENIZER_KINDS[kind]) * 40
    ids = tok.encode(text, add_bos=False)
    chunks: list[str] = []
    params = SamplingParams(max_new_tokens=len(ids), ignore_eos=True)
    req = Request(0, [0], params, on_text=lambda r, text: chunks.append(text))
    req.slot = text_llm.cache.admit(1)
    text_llm.tokenizer, text_llm.eos_ids = counting, tok.eos_ids
    per_token = []
    for token in ids:
        before = counting.decoded
        text_llm._accept(req, token)
        per_token.append(counting.decoded - before)
    assert len(ids) > 800 and max(per_token) <= 12
    assert req.text == "".join(chunks) == tok.decode(ids, skip_special=True)
