"""scripts/vs_llamacpp.sh's helpers, without a GPU: the table parser on the exact formats that the
pinned llama.cpp's tools print (llama-bench -o json, llama-batched-bench's markdown table), and the
GGUF writer's shape against the built-in shapes and nanokv's own model of them."""

from __future__ import annotations

import json
import re

import pytest

from scripts import make_gguf, peers_table

# One object as llama-bench (llama-cpp-python 0.3.36's llama.cpp, json_printer) prints it; the GPU
# fields as a CUDA build fills them. The other tests' objects are this one with fields replaced.
LLAMA_BENCH_OBJECT = """  {
    "build_commit": "0c1e570",
    "build_number": 0,
    "cpu_info": "AMD EPYC",
    "gpu_info": "NVIDIA H100 80GB HBM3",
    "backends": "CUDA",
    "model_filename": ".peers/models/llama3-8b-f16.gguf",
    "model_type": "llama 8B F16",
    "model_size": 16060522496,
    "model_n_params": 8030261248,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 8,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": 99,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": 1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 512,
    "n_gen": 0,
    "n_depth": 0,
    "test_time": "2026-11-22T21:24:20Z",
    "avg_ns": 484307,
    "stddev_ns": 25690,
    "avg_ts": 66166.678197,
    "stddev_ts": 3507.273071,
    "samples_ns": [ 502460, 466155 ],
    "samples_ts": [ 63686.7, 68646.7 ]
  }"""

# llama-batched-bench's stdout (default markdown output), as the pinned version printed it
BATCHED_BENCH_OUT = """
llama_batched_bench: n_kv_max = 12288, n_batch = 2048, n_ubatch = 512, flash_attn = 1, is_pp_shared = 0, is_tg_separate = 0, n_gpu_layers = 99, n_threads = 8, n_threads_batch = 8

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   512 |    128 |    1 |    640 |    0.061 |  8393.44 |    1.035 |   123.67 |    1.096 |   583.94 |
|   512 |    128 |   16 |  10240 |    0.857 |  9558.77 |    1.384 |  1479.77 |    2.241 |  4569.40 |

"""


def bench_object(**fields) -> str:
    text = LLAMA_BENCH_OBJECT
    for k, v in fields.items():
        value = json.dumps(v)
        text, n = re.subn(rf'("{k}": )[^,\n]*', lambda m: m.group(1) + value, text)
        assert n == 1, k
    return text


def bench_output(objects: list[str]) -> str:  # json_printer: header, objects joined by ',\n', footer
    return "[\n" + ",\n".join(objects) + "\n]\n"


def llama_bench_runs(kv: str, tg: dict[int, float], pp: float) -> str:
    """One llama-bench call: -p 512 -n 128 -d 0,512,32000 -ctk kv -ctv kv."""
    objs = []
    for depth, ts in tg.items():
        objs.append(bench_object(type_k=kv, type_v=kv, n_prompt=512, n_gen=0, n_depth=depth, avg_ts=pp))
        objs.append(bench_object(type_k=kv, type_v=kv, n_prompt=0, n_gen=128, n_depth=depth, avg_ts=ts))
    return bench_output(objs)


def nanokv_row(method, batch, prompt, decode, prefill_s=0.05):
    # the fields bench.py cmd_speed writes that the table reads, and a few others
    return dict(bench="speed", config="llama3-8b", method=method, batch=batch, prompt=prompt, new=128, e2e_s=1.2,
                prefill_s=prefill_s, decode_s=1.0, decode_steps=127, e2e_tok_s=100.0, decode_tok_s=decode,
                step_ms=1000 / decode * batch, device="NVIDIA H100 80GB HBM3")


def test_llama_bench_json_parses_whole_and_cut_short():
    text = llama_bench_runs("q8_0", {0: 130.0, 512: 128.0}, 9000.0)
    rows = peers_table.parse_llama_bench(text)
    assert [(r["n_prompt"], r["n_gen"], r["n_depth"]) for r in rows] == [(512, 0, 0), (0, 128, 0), (512, 0, 512), (0, 128, 512)]
    assert rows[1]["avg_ts"] == 130.0 and rows[1]["type_k"] == "q8_0" and rows[1]["samples_ts"] == [63686.7, 68646.7]
    # killed by the timeout during the third test: '[', two objects, ',' and half of the third
    cut = text[: text.index('"n_depth": 512')]
    assert len(peers_table.parse_llama_bench(cut)) == 2
    assert peers_table.parse_llama_bench("") == []


def test_batched_bench_markdown_and_jsonl():
    rows = peers_table.parse_batched_bench(BATCHED_BENCH_OUT)
    assert [(r["pp"], r["tg"], r["pl"], r["n_kv"]) for r in rows] == [(512, 128, 1, 640), (512, 128, 16, 10240)]
    assert rows[1]["speed_tg"] == 1479.77 and rows[1]["speed_pp"] == 9558.77
    assert rows[0]["flash_attn"] == 1 and rows[0]["n_kv_max"] == 12288
    # --output-format jsonl: the LOG format string of batched-bench.cpp
    line = ('{"n_kv_max": 12288, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 1, "is_pp_shared": 0, "n_gpu_layers": 99, '
            '"n_threads": 8, "n_threads_batch": 8, "pp": 512, "tg": 128, "pl": 16, "n_kv": 10240, "t_pp": 0.857000, '
            '"speed_pp": 9558.770000, "t_tg": 1.384000, "speed_tg": 1479.770000, "t": 2.241000, "speed": 4569.400000}')
    assert peers_table.parse_batched_bench("noise\n" + line + "\n")[0]["speed_tg"] == pytest.approx(1479.77)


def test_table_rows_and_ratios(tmp_path, capsys):
    files = []
    for kv, tg in [("f16", {0: 125.0, 512: 124.0, 32000: 100.0}), ("q8_0", {0: 130.0, 512: 129.0, 32000: 110.0}),
                   ("q4_0", {0: 128.0, 512: 127.0, 32000: 112.0})]:
        f = tmp_path / f"llama_bench_{kv}.out"
        f.write_text(llama_bench_runs(kv, tg, 9000.0))
        files += ["--llama-bench", str(f)]
    (tmp_path / "batched.out").write_text(BATCHED_BENCH_OUT)
    rows = [nanokv_row("fp16", 1, 512, 155.0), nanokv_row("kitty", 1, 512, 150.0),
            nanokv_row("fp16", 16, 512, 2000.0), nanokv_row("kitty", 16, 512, 2400.0),
            nanokv_row("fp16", 1, 32000, 120.0, prefill_s=4.0), nanokv_row("kitty", 1, 32000, 140.0, prefill_s=4.0)]
    (tmp_path / "nanokv.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md, js = tmp_path / "t.md", tmp_path / "t.json"
    peers_table.main([*files, "--batched-bench", f"f16={tmp_path / 'batched.out'}", "--nanokv", str(tmp_path / "nanokv.jsonl"),
                      "--gpu", "NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04, 9.0", "--md", str(md), "--json", str(js)])
    table = json.loads(js.read_text())["table"]

    def row(workload, engine, kv):
        (r,) = [r for r in table if r["workload"].startswith(workload) and r["engine"] == engine and r["kv"] == kv]
        return r

    # batch 1: llama-bench's tg at depth 512 (where nanokv's decode runs), its pp512 as the prefill
    r = row("batch 1, prompt 512", "nanokv", "fp16")
    assert r["vs_llamacpp_f16"] == pytest.approx(155 / 124) and r["vs_llamacpp_best"] == pytest.approx(155 / 129)
    assert r["best_llamacpp_kv"] == "q8_0" and r["prefill_tok_s"] == pytest.approx(512 / 0.05)
    assert row("batch 1, prompt 512", "llama.cpp llama-bench", "f16")["prefill_tok_s"] == 9000.0
    assert row("batch 1, prompt 512", "llama.cpp batched-bench", "f16")["decode_tok_s"] == 123.67
    # long context: tg at depth 32000
    assert row("batch 1, context 32000", "nanokv", "kitty")["vs_llamacpp_f16"] == pytest.approx(140 / 100)
    assert row("batch 1, context 32000", "llama.cpp llama-bench", "q4_0")["decode_tok_s"] == 112.0
    # batch 16: batched-bench's S_TG
    r = row("batch 16", "nanokv", "kitty")
    assert r["vs_llamacpp_f16"] == pytest.approx(2400 / 1479.77)
    assert row("batch 16", "llama.cpp batched-bench", "f16")["prefill_tok_s"] == 9558.77
    assert len(table) == 3 + 1 + 2 + 3 + 2 + 1 + 2
    out = capsys.readouterr().out
    assert "GPU: NVIDIA H100 80GB HBM3" in out and "WARNING" not in out and "missing" not in out
    assert md.read_text().strip() == out.strip()
    assert "| batch 16, prompt 512, +128 | nanokv | kitty | 2400.0 | 1.62 | 1.62 (f16) | 163840 | bench.py speed |" in out


def test_table_with_a_side_missing(tmp_path, capsys):
    (tmp_path / "nanokv.jsonl").write_text(json.dumps(nanokv_row("fp16", 1, 512, 155.0)) + "\n")
    peers_table.main(["--nanokv", str(tmp_path / "nanokv.jsonl"), "--llama-bench", str(tmp_path / "absent.out")])
    out = capsys.readouterr().out
    assert "missing (failed or skipped): llama-bench, batched-bench" in out
    assert "| batch 1, prompt 512, +128 | nanokv | fp16 | 155.0 |  |  |" in out


def test_gguf_shapes_follow_builtin_shapes():
    """The tensors make_gguf writes for each built-in shape (shapes.py) hold exactly as many weights
    as nanokv's own model of that shape."""
    import torch

    import shapes
    from model import ModelConfig, Transformer

    for name in ["llama3-8b", "llama3.1-8b", "qwen3-8b", "mistral-7b"]:
        s = make_gguf.shape(shapes.hf_config(name), _no_overrides())
        gguf_params = sum(_numel(shp) for _, shp, kind in make_gguf.tensor_specs(s) if kind != "rope")
        with torch.device("meta"):
            model = Transformer(ModelConfig.from_hf(shapes.hf_config(name)))
        assert gguf_params == sum(p.numel() for p in model.parameters()), name
    s = make_gguf.shape(shapes.hf_config("llama3.1-8b"), _no_overrides())
    factors = make_gguf.llama3_rope_factors(s)
    assert factors.shape == (64,) and factors[0] == 1.0 and factors[-1] == 8.0
    assert make_gguf.llama3_rope_factors(make_gguf.shape(shapes.hf_config("llama3-8b"), _no_overrides())) is None
    with pytest.raises(SystemExit):
        make_gguf.shape(shapes.hf_config("opt-6.7b"), _no_overrides())


def _no_overrides():
    import argparse

    return argparse.Namespace(layers=None, dim=None, ffn=None, heads=None, kv_heads=None, vocab=None)


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n
