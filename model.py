"""The model: ModelConfig (read from an HF config.json) and one Transformer for five families.

llama, qwen2, qwen3, mistral and opt differ only in switches of ModelConfig: the norm (RMS or
LayerNorm), the MLP (SiLU-gated or ReLU), biases, per-head q/k norms, rotary or learned
positions, pre- or post-norm, a sliding window, tied embeddings. There is one attention, one
block and one forward; nothing is copied per family.

Attention either runs causal SDPA over the tokens it is given (cache=None: prompts, training,
profiling) or hands q, k, v to a KV cache, which stores k and v and attends over everything
the sequence has seen (kvcache/). RMSNorm, RoPE and the SiLU gate call kernels/, which runs
them as one Triton kernel each on the GPU (a decode step is mostly such tiny ops) and as the
plain torch expressions elsewhere. Loading weights into this module is loading.py's job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "opt")


class UnsupportedModelError(ValueError):
    """The config describes a model this Transformer cannot run."""


@dataclass
class ModelConfig:
    arch: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    max_seq_len: int
    norm_eps: float = 1e-5
    layer_norm: bool = False  # LayerNorm with bias (opt) instead of RMSNorm
    gated_silu_mlp: bool = True  # SiLU(gate) * up -> down; else ReLU fc1 -> fc2 (opt)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # qwen3: RMSNorm over each head of q and k before RoPE
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    learned_positions: bool = False  # opt: position embeddings instead of RoPE
    pre_norm: bool = True  # opt-350m is post-norm
    final_norm: bool = True
    embed_dim: int | None = None  # opt's word_embed_proj_dim, when it differs from dim
    tie_embeddings: bool = False
    sliding_window: int | None = None  # mistral: attend to the last W positions only
    extra: dict = field(default_factory=dict, repr=False)  # the raw HF config, for reference

    @property
    def embedding_dim(self) -> int:
        return self.embed_dim or self.dim

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Build a config from an HF config.json dict (any of the supported model_types)."""
        arch = cfg.get("model_type")
        if arch not in SUPPORTED_ARCHS:
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r}; nanokv runs: {', '.join(SUPPORTED_ARCHS)}"
            )
        n_heads = cfg["num_attention_heads"]
        dim = cfg["hidden_size"]
        common = dict(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            dim=dim,
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            max_seq_len=cfg.get("max_position_embeddings", 2048),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", arch == "opt")),
            extra=cfg,
        )
        if arch == "opt":
            embed_dim = cfg.get("word_embed_proj_dim", dim)
            if cfg.get("activation_function", "relu") != "relu":
                raise UnsupportedModelError("opt: only activation_function='relu' is supported")
            bias = cfg.get("enable_bias", True)
            pre_norm = cfg.get("do_layer_norm_before", True)
            return cls(
                **common,
                n_kv_heads=n_heads,
                head_dim=dim // n_heads,
                ffn_dim=cfg["ffn_dim"],
                layer_norm=True,
                gated_silu_mlp=False,
                qkv_bias=bias,
                o_bias=bias,
                mlp_bias=bias,
                learned_positions=True,
                pre_norm=pre_norm,
                final_norm=pre_norm and not cfg.get("_remove_final_layer_norm", False),
                embed_dim=embed_dim if embed_dim != dim else None,
            )
        rope_theta, rope_scaling = _rope_settings(cfg)
        head_dim = cfg.get("head_dim") or dim // n_heads
        sliding = cfg.get("sliding_window") if arch == "mistral" else None
        return cls(
            **common,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            ffn_dim=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=bool(cfg.get("attention_bias", False)) and arch != "qwen2",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "qwen3",
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            sliding_window=sliding,
        )


def _rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """RoPE theta and scaling from either the old (rope_theta + rope_scaling) or the newer
    (rope_parameters) config layout."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = params.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
    scaling = params or cfg.get("rope_scaling") or None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            return float(theta), None
        if kind not in ("llama3", "linear"):
            raise UnsupportedModelError(f"rope scaling {kind!r} is not supported (llama3, linear are)")
        scaling = {**scaling, "rope_type": kind}
    return float(theta), scaling


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotation frequency of each channel pair, with Llama-3 or linear scaling applied."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = config.rope_scaling
    if s is None:
        return inv_freq.float()
    if s["rope_type"] == "linear":
        return (inv_freq / s["factor"]).float()
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_ctx / wavelen - low) / (high - low)).clamp(0, 1)
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return scaled.float()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


def make_norm(config: ModelConfig, dim: int) -> nn.Module:
    if config.layer_norm:
        return nn.LayerNorm(dim, eps=config.norm_eps)
    return RMSNorm(dim, config.norm_eps)


class Linear(nn.Linear):
    """nn.Linear whose decode-shaped calls run the fastest kernel measured for its shape (kernels.linear)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias)


class FusedLinear(Linear):
    """Several projections of the same input stored as one matrix, their rows stacked in the
    order of `parts` (name -> rows), so a decode step reads them in one matmul.

    At batch 1 a matmul is a read of its weight, and a small one (Llama-3-8B's k and v are
    8 MB each) reaches a fraction of the bandwidth a large one does. Checkpoints still name the
    parts: Transformer.checkpoint_tensors() gives each part's rows as a view to load into.
    """

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool):
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = parts

    def part_views(self) -> dict[str, torch.Tensor]:
        """'{part}.weight' / '{part}.bias' -> the rows of that part (views: writes go through)."""
        views = {}
        for kind in ("weight", "bias"):
            tensor = getattr(self, kind)
            if tensor is not None:
                for part, rows in zip(self.parts, tensor.detach().split(list(self.parts.values()), dim=0)):
                    views[f"{part}.{kind}"] = rows
        return views


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.sliding_window = config.sliding_window
        hd = config.head_dim
        kv = config.n_kv_heads * hd
        self.qkv_proj = FusedLinear(config.dim, {"q_proj": config.n_heads * hd, "k_proj": kv, "v_proj": kv},
                                    bias=config.qkv_bias)
        self.o_proj = Linear(config.n_heads * hd, config.dim, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.norm_eps)
            self.k_norm = RMSNorm(hd, config.norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, cache) -> torch.Tensor:
        B, T, _ = x.shape
        H, Hkv = self.n_heads, self.n_kv_heads
        qkv = self.qkv_proj(x).view(B, T, H + 2 * Hkv, self.head_dim).transpose(1, 2)  # heads q | k | v
        v = qkv[:, H + Hkv:]
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(qkv[:, :H]), self.k_norm(qkv[:, H:H + Hkv])
        else:
            q, k = qkv[:, :H], qkv[:, H:H + Hkv]
        if cache is not None:  # the cache rotates q and k (at decode, in the kernel that stores k and v)
            o = cache.attend(self.layer_idx, q, k, v, rope)
        else:
            if rope is not None:
                q, k = kernels.apply_rope(q, *rope), kernels.apply_rope(k, *rope)
            o = kernels.causal_attention(q, k, v, self.sliding_window)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gated = config.gated_silu_mlp
        d, f, b = config.dim, config.ffn_dim, config.mlp_bias
        if self.gated:
            self.gate_up_proj = FusedLinear(d, {"gate_proj": f, "up_proj": f}, bias=b)
            self.down_proj = Linear(f, d, bias=b)
        else:
            self.fc1 = Linear(d, f, bias=b)
            self.fc2 = Linear(f, d, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(kernels.silu_mul(*self.gate_up_proj(x).chunk(2, dim=-1)))
        return self.fc2(F.relu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.pre_norm = config.pre_norm
        self.attn_norm = make_norm(config, config.dim)
        self.attn = Attention(config, layer_idx)
        self.mlp_norm = make_norm(config, config.dim)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, rope, cache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The residual stream x, plus `pending`: the previous block's MLP output, not yet added
        (pre-norm adds it inside this block's first norm kernel). Returns this block's (x, pending)."""
        if self.pre_norm:
            x, normed = add_then_norm(self.attn_norm, x, pending)
            x, normed = add_then_norm(self.mlp_norm, x, self.attn(normed, rope, cache))
            return x, self.mlp(normed)
        # post-norm (opt-350m): normalise after each residual add
        x = self.attn_norm(x + self.attn(x, rope, cache))
        return self.mlp_norm(x + self.mlp(x)), None


def add_then_norm(norm: nn.Module, x: torch.Tensor, h: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, norm(x + h)); h None adds nothing. An RMSNorm does both in one kernel: at batch 1
    the residual add is a launch of its own for a few KB of work."""
    if h is None:
        return x, norm(x)
    if isinstance(norm, RMSNorm):
        return kernels.add_rms_norm(x, h, norm.weight, norm.eps)
    x = x + h
    return x, norm(x)


def build(config: ModelConfig, device: str | torch.device, dtype: torch.dtype,
          shard: Callable[[Transformer], Transformer] | None = None) -> Transformer:
    """A Transformer whose parameters are allocated, not initialised, in `dtype` on `device`.
    It is built on the meta device first, so that `shard` (tp.py) can swap in this rank's slices
    before any memory is taken; the RoPE frequencies stay float32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = Transformer(config)
        if shard is not None:
            model = shard(model)
        model = model.to_empty(device=device)
    finally:
        torch.set_default_dtype(previous)
    if not config.learned_positions:
        model.inv_freq = rope_inv_freq(config).to(device)  # to_empty left the buffer unset
    return model.eval()


class Transformer(nn.Module):
    OPT_POSITION_OFFSET = 2  # OPT's learned position table starts at row 2

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        e = config.embedding_dim
        self.tok_embeddings = nn.Embedding(config.vocab_size, e)
        if config.learned_positions:
            self.pos_embeddings = nn.Embedding(config.max_seq_len + self.OPT_POSITION_OFFSET, config.dim)
        if e != config.dim:
            self.project_in = Linear(e, config.dim, bias=False)
            self.project_out = Linear(config.dim, e, bias=False)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        if config.final_norm:
            self.norm = make_norm(config, config.dim)
        if not config.tie_embeddings:
            self.lm_head = Linear(e, config.vocab_size, bias=False)
        if not config.learned_positions:
            self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor a checkpoint supplies, by its name in HF's layout (q_proj, gate_proj, ...
        as separate matrices), each a view of the parameter it lives in: loading copies into these."""
        tensors = {}
        for name, tensor in self.state_dict().items():
            module_name, _ = name.rsplit(".", 1)
            module = self.get_submodule(module_name)
            if isinstance(module, FusedLinear):
                parent = module_name.rpartition(".")[0]
                tensors.update({f"{parent}.{part}": view for part, view in module.part_views().items()})
            else:
                tensors[name] = tensor
        return tensors

    def output_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.config.tie_embeddings else self.lm_head.weight

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None, cache=None,
                last_only: bool = False) -> torch.Tensor:
        """Logits [B, T, vocab] for token ids [B, T] at absolute positions [B, T] (default 0..T-1);
        last_only: logits of the last position only, [B, 1, vocab] (a prefill samples only from
        it, and an 8k-token prompt's full logits would take gigabytes)."""
        B, T = ids.shape
        if positions is None:
            positions = torch.arange(T, device=ids.device).expand(B, T)
        x = self.tok_embeddings(ids)
        if hasattr(self, "project_in"):
            x = self.project_in(x)
        rope = None
        if self.config.learned_positions:
            x = x + self.pos_embeddings(positions + self.OPT_POSITION_OFFSET)
        else:
            angles = positions[..., None].float() * self.inv_freq
            angles = torch.cat((angles, angles), dim=-1)[:, None]  # [B, 1, T, D] broadcast over heads
            rope = (angles.cos().to(x.dtype), angles.sin().to(x.dtype))
        pending = None
        for layer in self.layers:
            x, pending = layer(x, pending, rope, cache)
        if last_only:
            x, pending = x[:, -1:], None if pending is None else pending[:, -1:]
        if hasattr(self, "norm"):
            x = add_then_norm(self.norm, x, pending)[1]
        elif pending is not None:
            x = x + pending
        if hasattr(self, "project_out"):
            x = self.project_out(x)
        if self.config.tie_embeddings:
            return kernels.linear(x, self.tok_embeddings.weight)
        return self.lm_head(x)  # a module, so that tp.py can swap in a vocab-parallel head
