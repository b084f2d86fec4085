"""Write a GGUF with random F16 weights of the shape that `bench.py speed --config C` times, so that
llama.cpp's llama-bench / llama-batched-bench run the very same shape as nanokv.

The shape comes from shapes.hf_config (a built-in config name or a config.json path), as bench.py's
does, so the two cannot disagree. Speed only: one random array per tensor shape, shared by every layer.
Needs nanokv's requirements (shapes.py imports torch) and the gguf package.

    python scripts/make_gguf.py --config llama3-8b --out .peers/models/llama3-8b-f16.gguf

Cached: when OUT exists with exactly the size this shape gives, nothing is written (--force rewrites).
--layers/--hidden/--ffn/--heads/--kv-heads/--vocab shrink the shape for smoke tests.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from shapes import hf_config  # noqa: E402  (the shapes bench.py speed times)
from model import rope_inv_freq  # noqa: E402

# model_type in the HF config -> llama.cpp architecture (the tensor names below are the same)
ARCHS = {"llama": "llama", "mistral": "llama", "qwen3": "qwen3"}


def shape(cfg: dict, args) -> dict:
    if cfg.get("model_type") not in ARCHS:
        raise SystemExit(f"error: model_type {cfg.get('model_type')!r} has no llama.cpp architecture here "
                         f"(supported: {', '.join(ARCHS)})")
    s = dict(arch=ARCHS[cfg["model_type"]], vocab=cfg["vocab_size"], dim=cfg["hidden_size"], ffn=cfg["intermediate_size"],
             layers=cfg["num_hidden_layers"], heads=cfg["num_attention_heads"],
             kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
             ctx=cfg.get("max_position_embeddings", 4096), theta=float(cfg.get("rope_theta", 10000.0)),
             eps=float(cfg.get("rms_norm_eps", 1e-5)), tied=bool(cfg.get("tie_word_embeddings", False)),
             rope_scaling=cfg.get("rope_scaling"), head_dim=cfg.get("head_dim"))
    for k in ("layers", "dim", "ffn", "heads", "kv_heads", "vocab"):
        if getattr(args, k) is not None:
            s[k] = getattr(args, k)
    s["head_dim"] = s["head_dim"] or s["dim"] // s["heads"]
    return s


def llama3_rope_factors(s: dict) -> np.ndarray | None:
    """rope_freqs.weight for llama3-type RoPE scaling: how much slower each channel pair turns than
    unscaled RoPE (llama.cpp divides its frequencies by these), from nanokv's own rope_inv_freq."""
    rs = s["rope_scaling"] or {}
    if rs.get("rope_type", rs.get("type")) != "llama3":
        return None
    rope = dict(head_dim=s["head_dim"], rope_theta=s["theta"])
    plain = rope_inv_freq(SimpleNamespace(**rope, rope_scaling=None))
    scaled = rope_inv_freq(SimpleNamespace(**rope, rope_scaling={**rs, "rope_type": "llama3"}))
    return (plain / scaled).numpy()


def tensor_specs(s: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape, kind) in file order; kind: 'w' random F16, 'ones' F32 norm, 'rope' F32 factors."""
    d, hd, f = s["dim"], s["head_dim"], s["ffn"]
    specs = [("token_embd.weight", (s["vocab"], d), "w"), ("output_norm.weight", (d,), "ones")]
    if not s["tied"]:
        specs.append(("output.weight", (s["vocab"], d), "w"))
    if llama3_rope_factors(s) is not None:
        specs.append(("rope_freqs.weight", (hd // 2,), "rope"))
    for i in range(s["layers"]):
        p = f"blk.{i}."
        specs += [(p + "attn_norm.weight", (d,), "ones"), (p + "ffn_norm.weight", (d,), "ones"),
                  (p + "attn_q.weight", (s["heads"] * hd, d), "w"), (p + "attn_k.weight", (s["kv_heads"] * hd, d), "w"),
                  (p + "attn_v.weight", (s["kv_heads"] * hd, d), "w"), (p + "attn_output.weight", (d, s["heads"] * hd), "w")]
        if s["arch"] == "qwen3":
            specs += [(p + "attn_q_norm.weight", (hd,), "ones"), (p + "attn_k_norm.weight", (hd,), "ones")]
        specs += [(p + "ffn_gate.weight", (f, d), "w"), (p + "ffn_up.weight", (f, d), "w"), (p + "ffn_down.weight", (d, f), "w")]
    return specs


def new_writer(gguf, path: Path, s: dict):
    w = gguf.GGUFWriter(str(path), s["arch"])
    w.add_name(f"nanokv random {s['arch']}")
    hyper = {"context_length": "ctx", "embedding_length": "dim", "block_count": "layers",
             "feed_forward_length": "ffn", "head_count": "heads", "head_count_kv": "kv_heads",
             "key_length": "head_dim", "value_length": "head_dim", "rope_dimension_count": "head_dim",
             "rope_freq_base": "theta", "layer_norm_rms_eps": "eps", "vocab_size": "vocab"}
    for field, key in hyper.items():  # w.add_<field>(value): the GGUF keys llama.cpp reads for the shape
        getattr(w, f"add_{field}")(s[key])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    # a SentencePiece-style vocabulary of placeholder pieces: the benchmarks feed random token ids
    n = s["vocab"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens = (tokens + [f"t{i}" for i in range(max(0, n - len(tokens)))])[:n]
    types = ([2, 3, 3] + [6] * 256 + [1] * n)[:n]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    return w


def expected_size(gguf, s: dict, tmp: Path) -> int:
    """The file's size in bytes: header, metadata and tensor infos written for real to a scratch
    file (a few MB), plus each tensor's bytes padded to the alignment."""
    w = new_writer(gguf, tmp, s)
    for name, shp, kind in tensor_specs(s):
        dtype = np.float16 if kind == "w" else np.float32
        w.add_tensor_info(name, shp, np.dtype(dtype), int(np.prod(shp)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    head = w.fout[0].tell()
    align = w.data_alignment
    data = sum(w.ggml_pad(ti.nbytes, align) for ti in w.tensors[0].values())
    w.close()
    tmp.unlink()
    return w.ggml_pad(head, align) + data


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama3-8b", help="a bench.py config name or a config.json path")
    ap.add_argument("--out", default=None, help="default: .peers/models/<config>-f16.gguf")
    ap.add_argument("--force", action="store_true", help="write even when OUT already has the right size")
    ap.add_argument("--check", action="store_true", help="only say whether OUT is there with the right size (exit 1 if not)")
    ap.add_argument("--seed", type=int, default=0)
    for k in ("layers", "hidden", "ffn", "heads", "kv-heads", "vocab"):
        ap.add_argument(f"--{k}", type=int, default=None, help="override (smoke tests)")
    args = ap.parse_args(argv)
    args.dim = args.hidden
    import gguf

    try:
        cfg = hf_config(args.config)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    s = shape(cfg, args)
    out = Path(args.out or ROOT / ".peers" / "models" / f"{Path(args.config).stem if args.config.endswith('.json') else args.config}-f16.gguf")
    out.parent.mkdir(parents=True, exist_ok=True)
    size = expected_size(gguf, s, out.with_name(out.name + ".head"))
    desc = (f"{args.config}: arch {s['arch']}, {s['layers']} layers, dim {s['dim']}, ffn {s['ffn']}, heads {s['heads']}/"
            f"{s['kv_heads']} x {s['head_dim']}, vocab {s['vocab']}, {size / 1e9:.2f} GB")
    have = out.stat().st_size if out.exists() else None
    if args.check:
        print(f"{out}: {'ok' if have == size else f'size {have}, want {size}'} ({desc})")
        sys.exit(0 if have == size else 1)
    if have == size and not args.force:
        print(f"cached {out} ({desc})")
        return
    t0 = time.time()
    rng = np.random.default_rng(args.seed)
    arrays: dict[tuple, np.ndarray] = {}

    def array(shp, kind):
        if kind == "ones":
            return np.ones(shp, dtype=np.float32)
        if kind == "rope":
            return llama3_rope_factors(s)
        if shp not in arrays:  # uniform with std 0.02 (as bench.py's normal_(0, 0.02)); faster to draw
            a = rng.random(shp, dtype=np.float32)
            a -= 0.5
            a *= 0.02 * math.sqrt(12)
            arrays[shp] = a.astype(np.float16)
        return arrays[shp]

    tmp = out.with_name(out.name + ".tmp")
    w = new_writer(gguf, tmp, s)
    for name, shp, kind in tensor_specs(s):
        w.add_tensor(name, array(shp, kind))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    got = tmp.stat().st_size
    if got != size:
        raise SystemExit(f"error: wrote {got} bytes, expected {size}")
    os.replace(tmp, out)
    print(f"wrote {out} in {time.time() - t0:.0f}s ({desc})")


if __name__ == "__main__":
    main()
