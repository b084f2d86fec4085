"""The hooks bench.py drives, on a tiny model: quality's teacher forcing against HF transformers'
full forward, and the capacity bench's synthetic sequences against the token counts they must
produce; and the quality command's refusal of a context too short to encode a page."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import synthetic_decode, teacher_forced_logprobs
from llm import LLM
from tests.tiny_models import make_tiny_model


@pytest.mark.parametrize("block", [1, 32])
def test_teacher_forced_logprobs_match_a_full_forward(tmp_path, block):
    """With the fp16 method, feeding the text through the cache (prefill, then blocks of
    `block` tokens) gives the next-token log-probabilities of one causal forward, up to fp16
    rounding of the pages."""
    hf = make_tiny_model("llama", tmp_path)
    llm = LLM(str(tmp_path), device="cpu", kv_budget_gb=0.05, max_batch=1, sink=4, window=8, progress=False)
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(8)).tolist()
    prefix = 20
    ours = teacher_forced_logprobs(llm, ids, prefix, block)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)[prefix - 1:-1]
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=0)
    assert llm.cache.pool.num_free == llm.cache.pool.num_pages


def test_synthetic_decode_runs_the_engine_loop_to_the_end(tmp_path):
    """Sequences that pretend to hold ctx tokens decode `steps` tokens each through the engine's
    own loop, at the positions after their context, and then leave the cache empty."""
    make_tiny_model("llama", tmp_path)
    llm = LLM(str(tmp_path), device="cpu", kv_budget_gb=0.05, max_batch=3, sink=4, window=8, progress=False)
    ctx, steps = 300, 7
    stored = []
    attend = llm.cache.attend

    def watch(layer, q, k, v, rope=None):  # what the first layer's attention sees at each decode step
        if layer == 0:
            stored.append(llm.cache.kv_stats()["layers"][0]["tokens"])
        return attend(layer, q, k, v, rope)

    llm.cache.attend = watch
    synthetic_decode(llm, 3, ctx, steps)
    assert llm.timing["decode_steps"] == steps - 1 and llm.timing["decode_tokens"] == 3 * (steps - 1)
    assert stored == [3 * (ctx + i) for i in range(steps - 1)]  # the context, then one more token a step
    assert not llm.has_work()
    assert llm.cache.pool.num_free == llm.cache.pool.num_pages and llm.cache.num_free_slots == 3


def test_quality_refuses_a_context_that_encodes_no_page(tmp_path):
    """At 256 tokens with the default sink 32 and window 128, no page is ever written: the quality
    bench must refuse rather than report kitty as lossless."""
    make_tiny_model("llama", tmp_path)
    text = tmp_path / "text.txt"
    text.write_text("lorem ipsum dolor sit amet " * 200)
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "bench.py", "quality", "--model", str(tmp_path), "--text", str(text),
                          "--ctx", "256", "--kv", "fp16,kitty", "--device", "cpu"], cwd=root, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert "encodes no page" in run.stderr.strip().splitlines()[-1], run.stderr


def test_kernel_variant_names_parse_into_launches():
    """`bench.py kernels --variants` names: dash-separated Launch fields, every variant without PDL;
    an unknown field is refused with the list of known ones."""
    from benchmarks.kernels import variant
    from kernels.attention import Launch

    assert variant("auto") == Launch(pdl=False)
    assert variant("n4-k3-w2") == Launch(block_n=4, num_splits=3, num_warps=2, pdl=False)
    assert variant("s16-r168-noasm") == Launch(step=16, maxnreg=168, asm=False, pdl=False)
    assert variant("u4-n4") == Launch(softmax_steps=4, block_n=4, pdl=False)
    with pytest.raises(ValueError, match="unknown kernel variant field 'x3'"):
        variant("n4-x3")


def test_speed_and_capacity_take_a_kvmix_plan_for_other_layer_counts(tmp_path, monkeypatch):
    """`speed` and `capacity` run random-weight shapes whose layer count is not the shipped plan's
    (SmolLM2-135M's 30): without --kv-plan kvmix is refused with an error naming the flag, with one
    each layer gets the plan's own bits (the plan file is the oracle), and the engine is built with it."""
    import json

    import bench
    from bench import build_parser, cache_settings, cache_shape
    from shapes import random_model

    cfg = dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=32,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5)
    model = random_model(cfg, "cpu", torch.float16)
    bits = [(2, 2) if i % 3 else (4, 3) for i in range(32)]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"method": "kvmix", "layers": [
        {"k_bits": k, "v_bits": v, "window_ratio": 0.1} for k, v in bits]}))
    for command in ("speed", "capacity"):
        extra = ["--budget-gb", "1"] if command == "capacity" else []
        args = build_parser().parse_args([command, "--kv", "kvmix", *extra])
        with pytest.raises(ValueError, match="--kv-plan"):
            cache_shape(model, "kvmix", args)
        args = build_parser().parse_args([command, "--kv", "kvmix", "--kv-plan", str(plan), *extra])
        shape = cache_shape(model, "kvmix", args)
        assert [(f.k.bits, f.v.bits) for f in shape.formats] == bits
        assert cache_settings(args)["kv_plan"] == str(plan)  # what both commands' engines are built with
    built = {}
    monkeypatch.setattr(bench, "LLM", lambda model, **settings: built.update(settings))
    bench.speed_llm(model, "kvmix", 2, 1000, build_parser().parse_args(["speed", "--kv-plan", str(plan)]))
    assert built["kv_plan"] == str(plan) and built["kv"] == "kvmix"
