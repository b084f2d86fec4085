"""Built-in model shapes: the real hyperparameters of a few models (their HF config.json), and a
Transformer of such a shape with random weights built on the device. Decode speed does not depend
on the weights' values, so the speed and capacity benchmarks, the GGUF maker for llama.cpp
(scripts/make_gguf.py) and a server started with --config all run on these.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import tp as tp_group
from model import ModelConfig, Transformer, build

CONFIGS = {
    "llama3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # Llama-3.1-8B: the same shape with its 128k context (llama3 RoPE scaling); a long page table
    "llama3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=8192)),
    # Llama-3-70B: tensor-parallel benchmarks (its 141 GB of bf16 weights need two H200s)
    "llama3-70b": dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                       num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, rope_theta=500000.0,
                       max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rope_theta=1000000.0, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "mistral-7b": dict(model_type="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rope_theta=1000000.0,
                       max_position_embeddings=32768, rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False),
    "opt-6.7b": dict(model_type="opt", vocab_size=50272, hidden_size=4096, ffn_dim=16384, num_hidden_layers=32,
                     num_attention_heads=32, max_position_embeddings=2048, word_embed_proj_dim=4096,
                     do_layer_norm_before=True, activation_function="relu", tie_word_embeddings=True),
}


def hf_config(name_or_path: str) -> dict:
    """The HF config of a built-in shape, or of a config.json file."""
    if name_or_path in CONFIGS:
        return dict(CONFIGS[name_or_path])
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"--config {name_or_path!r} is neither a built-in ({', '.join(CONFIGS)}) nor a config.json file")
    return json.loads(path.read_text())


def random_model(cfg: dict, device: str, dtype: torch.dtype, max_seq_len: int | None = None,
                 tp: tp_group.Group | None = None) -> Transformer:
    """A Transformer of the config's real shape with random weights, built directly on the device
    (with tp, only this rank's slice of it: a 70B shape never exists whole on one GPU)."""
    config = ModelConfig.from_hf(cfg)
    if max_seq_len:
        config.max_seq_len = max(config.max_seq_len, max_seq_len)
    model = build(config, device, dtype, (lambda m: tp_group.shard(m, tp)) if tp else None)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    return model


def weight_bytes_per_step(model: Transformer) -> int:
    """Bytes of weights a decode step reads: everything but the embedding table (one row a token)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_embeddings:
        total -= model.tok_embeddings.weight.numel() * model.tok_embeddings.weight.element_size()
    return total


class TokenIdText:
    """The tokenizer of a random-weight shape, which has no vocabulary: text is the token ids
    written out ("12 7 99 "). A server can then run a real model's shape for benchmarks, which
    send prompts as token ids and count the tokens they get back."""

    eos_ids: set[int] = set()

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        try:
            ids = [int(word) for word in text.split()]
        except ValueError:
            raise ValueError("a random-weight model reads text as token ids separated by spaces, e.g. '12 7 99'") from None
        if not all(0 <= i < self.vocab_size for i in ids):
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        return ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return "".join(f"{i} " for i in ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        raise ValueError("a random-weight model has no chat template: use /v1/completions")
