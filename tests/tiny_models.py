"""Tiny random HF models of every family, saved as safetensors folders: the oracle's inputs."""

from __future__ import annotations

from pathlib import Path

import tokenizers
import torch
import transformers as tf

COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512)

CONFIGS = {
    # llama with GQA and Llama-3 rope scaling (the newer rope_parameters layout in transformers 5)
    "llama": lambda: tf.LlamaConfig(**COMMON, num_key_value_heads=2, intermediate_size=96,
                                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": lambda: tf.Qwen2Config(**COMMON, num_key_value_heads=2, intermediate_size=96, tie_word_embeddings=True),
    "qwen3": lambda: tf.Qwen3Config(**COMMON, num_key_value_heads=1, intermediate_size=96, head_dim=32),
    "mistral": lambda: tf.MistralConfig(**COMMON, num_key_value_heads=2, intermediate_size=96, sliding_window=24),
    "opt": lambda: tf.OPTConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=96,
                                max_position_embeddings=512, word_embed_proj_dim=32),
}
FAMILIES = list(CONFIGS)


def make_tiny_model(family: str, folder: Path, seed: int = 0, config: dict | None = None,
                    **save_kwargs) -> torch.nn.Module:
    """Build a random HF model of this family (config: fields to change), save it to `folder` and
    return it (eval, fp32)."""
    torch.manual_seed(seed)
    hf_config = CONFIGS[family]()
    for key, value in (config or {}).items():
        setattr(hf_config, key, value)
    model = tf.AutoModelForCausalLM.from_config(hf_config).eval()
    # Random init at std 0.02 gives near-uniform logits; widen it so greedy choices are clear-cut.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2 if "embed" in name else 0.08)
    model.save_pretrained(folder, **save_kwargs)
    byte_level_tokenizer().save(str(folder / "tokenizer.json"))
    return model


def byte_level_tokenizer() -> tokenizers.Tokenizer:
    """A 256-token byte-level tokenizer (no merges), so the tiny models load like real ones."""
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    return tok
