"""Tensor parallelism on CPU: two gloo processes (torch.multiprocessing spawn) run each family's
tiny model split in two, and their logits and greedy tokens are checked against one process and
against HF transformers. GGUF slices are checked against the gguf package's dequantization of the
whole tensor. NANOKV_TEST_DEVICE=cuda runs the same on two GPUs (NCCL, CUDA graphs), where greedy
tokens may differ from HF's only at HF's own near ties, as in test_engine.

Oracles: HF transformers (fp32 forward and greedy generate) for the unquantized cache; the same
engine in one process for Kitty, whose rounding makes HF no oracle (each rank ranks and encodes
its own KV heads, as one process does per head, so the two agree up to the order of sums).
"""

from __future__ import annotations

import faulthandler
import os
import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import transformers as tf

import loading
import tp
from llm import LLM
from sampling import SamplingParams
from tests.test_engine import DEVICE, DTYPE, LOGIT_ATOL, PAGE_ATOL, assert_same_greedy
from tests.test_loading import SYNTHETIC, hf_to_gguf
from tests.tiny_models import FAMILIES, make_tiny_model

# every family with KV heads that split in two; llama's vocabulary (255) does not, so its LM
# head's last slice is padded
TP_CONFIGS = {family: {"num_key_value_heads": 2} for family in FAMILIES if family != "opt"}
TP_CONFIGS["opt"] = {}
TP_CONFIGS["llama"]["vocab_size"] = 255
KV_METHODS = ("fp16", "kitty")
# fp16 on the GPU: a sum in another order can move a Kitty key element across a 2-bit rounding
# boundary, one code step; seen up to 0.042 on H200 (on CPU, in fp32, within LOGIT_ATOL)
KITTY_GPU_ATOL = LOGIT_ATOL if DEVICE == "cpu" else 0.1
# small tiers so that ~200 tokens fill pages: a page is encoded at sink + window + 128 tokens
CACHE = dict(sink=4, window=8, kv_budget_gb=0.05, max_batch=4, progress=False, device=DEVICE, dtype=DTYPE)
PROMPTS = [list(range(3, 40)), [7, 1, 200, 13] * 6]
FORCED = torch.randint(0, 250, (200,), generator=torch.Generator().manual_seed(3)).tolist()
BLOCKS = [40] + [1] * 160  # a prefill block, then 160 decode steps (a page is written at 140)


def run_engine(model, tp: int, kv: str, tokenizer=None) -> dict | None:
    """Teacher-forced logits, greedy and seeded sampled tokens of one engine; None on followers."""
    llm = LLM(model, tokenizer, kv=kv, tp=tp, **CACHE)
    if not llm.is_leader:
        llm.follow()
        return None
    logits = llm.teacher_force(FORCED, BLOCKS)
    greedy = [r.output_ids for r in llm.generate(PROMPTS, SamplingParams(max_new_tokens=12, ignore_eos=True))]
    sampled = llm.generate(PROMPTS[:1], SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=5))
    llm.close()
    return {"logits": logits.float().cpu(), "greedy": greedy, "sampled": sampled[0].output_ids}


def _join(rank: int, port: int) -> None:
    """Be rank `rank` of 2, as torchrun would set it up; a hang ends in a traceback, not a stuck CI."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(600, exit=True)


def _done() -> None:
    """A worker that finished: exit without the interpreter's teardown, in which torch 2.13's
    gloo sometimes aborts a process (seen in about 1 of 50 runs even after a final barrier)."""
    os._exit(0)


def _worker(rank: int, port: int, cases: dict, out: str) -> None:
    _join(rank, port)
    results = {}
    for name, (source, kv) in cases.items():
        if name == "refused":
            try:
                LLM(source, tp=2, **CACHE)
            except ValueError as e:
                results[name] = str(e)
            continue
        if source.endswith(".gguf"):  # no tokenizer in it: the model alone, split as it loads
            group = tp.init(2, torch.device(DEVICE))
            source = loading.load_weights(source, device=group.device, dtype=DTYPE, progress=False, tp=group)
        results[name] = run_engine(source, 2, kv)
    if rank == 0:
        torch.save(results, out)
    _done()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """Every case run once with tp=2 in two spawned processes: (HF models, folders, their results).
    NANOKV_TEST_DEVICE=cuda runs them on two GPUs over NCCL, with CUDA graphs."""
    if DEVICE == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("NANOKV_TEST_DEVICE=cuda: tensor parallelism needs two GPUs")
    root = tmp_path_factory.mktemp("tp")
    hf, cases = {}, {}
    for family, config in TP_CONFIGS.items():
        hf[family] = make_tiny_model(family, root / family, config=config)
        for kv in KV_METHODS:
            cases[f"{family}/{kv}"] = (str(root / family), kv)
    torch.manual_seed(0)
    hf["gguf"] = tf.AutoModelForCausalLM.from_config(SYNTHETIC["llama"]()).eval()
    with torch.no_grad():
        for p in hf["gguf"].parameters():
            p.normal_(0, 0.1)
    cases["gguf/fp16"] = (str(hf_to_gguf(hf["gguf"], "llama", root / "m.gguf")), "fp16")
    make_tiny_model("qwen3", root / "qwen3-1kv")  # one KV head: cannot split in two
    cases["refused"] = (str(root / "qwen3-1kv"), None)
    out = root / "results.pt"
    mp.spawn(_worker, args=(_free_port(), cases, str(out)), nprocs=2, join=True)
    return hf, cases, torch.load(out, weights_only=True)


@pytest.mark.parametrize("family,kv", [(f, kv) for f in TP_CONFIGS for kv in KV_METHODS] + [("gguf", "fp16")])
def test_tp2_equals_one_process_and_hf(tp_run, family, kv):
    hf, cases, results = tp_run
    source = cases[f"{family}/{kv}"][0]
    got = results[f"{family}/{kv}"]
    if source.endswith(".gguf"):
        source = loading.load_weights(source, device=DEVICE, dtype=DTYPE, progress=False)
    one = run_engine(source, 1, kv)
    torch.testing.assert_close(got["logits"], one["logits"], atol=KITTY_GPU_ATOL if kv == "kitty" else LOGIT_ATOL, rtol=0)
    assert got["sampled"] == one["sampled"]
    if kv == "fp16":  # the unquantized cache against HF itself (its pages store fp16: test_engine's tolerance)
        with torch.no_grad():
            ref = hf[family](torch.tensor([FORCED])).logits[0]
        torch.testing.assert_close(got["logits"], ref, atol=PAGE_ATOL, rtol=0)
        for prompt, ours in zip(PROMPTS, got["greedy"]):
            assert_same_greedy(hf[family], prompt, ours)
    else:
        assert got["greedy"] == one["greedy"]


def test_tp_refuses_heads_that_do_not_split(tp_run):
    message = tp_run[2]["refused"]
    assert "--tp 2 does not divide this model" in message and "use --tp 1" in message


def test_tp_outside_torchrun_names_the_command(tmp_path):
    for key in ("RANK", "WORLD_SIZE"):
        assert key not in os.environ
    make_tiny_model("llama", tmp_path)
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        LLM(str(tmp_path), tp=2, **CACHE)


@pytest.mark.parametrize("name", ["token_embd.weight", "blk.0.ffn_down.weight", "blk.0.attn_q.weight", "blk.0.attn_norm.weight"])
def test_gguf_slices_equal_the_whole_tensor_dequantized(name):
    """Rows, and columns that start and end inside a quantization block, read alone."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(loading.default_model_path())
    t = next(t for t in reader.tensors if t.name == name)
    whole = dequantize(t.data, t.tensor_type)
    heads = 9 if name.endswith("attn_q.weight") else None
    if heads:
        whole = loading._unpermute(whole, heads)
    stored = loading._gguf_stored(t, heads)
    assert stored.shape == whole.shape
    if whole.ndim == 1:
        index = (slice(100, 333),)
    else:
        rows = (slice(192, 384) if heads else slice(5, 77))  # heads: whole heads 3..5 of 64 rows
        index = (rows, slice(45, 301))  # blocks of 32: from inside one to inside another
    np.testing.assert_array_equal(stored.read(index).numpy(), whole[index])



def _dying_worker(rank: int, port: int, folder: str, out: str) -> None:
    _join(rank, port)
    llm = LLM(folder, tp=2, **CACHE)
    if rank == 1:
        os._exit(3)  # a rank that dies with the group running
    try:
        llm.generate(PROMPTS, SamplingParams(max_new_tokens=4, ignore_eos=True))
        message = "no error"
    except tp.RankLost as e:
        message = str(e)
    with open(out, "w") as f:
        f.write(message)
    _done()


def test_a_dead_rank_stops_the_others_with_a_clear_error(tmp_path):
    make_tiny_model("llama", tmp_path / "m", config=TP_CONFIGS["llama"])
    out = tmp_path / "message.txt"
    context = mp.spawn(_dying_worker, args=(_free_port(), str(tmp_path / "m"), str(out)), nprocs=2, join=False)
    context.processes[0].join(timeout=120)
    for process in context.processes:
        if process.is_alive():
            process.kill()
    assert out.read_text().startswith("tensor parallel: another rank is gone, so rank 0 stops too")


def _message_worker(rank: int, port: int, out: str) -> None:
    _join(rank, port)
    group = tp.init(2, torch.device("cpu"))
    messages = [{"then": "step", "told": []}, {"ids": list(range(5000)), "text": "é" * 3000}]  # the second > 8 KB
    if group.leader:
        for m in messages:
            group.send(m)
    else:
        torch.save({"same": [group.receive() for _ in messages] == messages}, out)
    group.barrier()  # as LLM.close does
    _done()


def test_messages_short_and_long_arrive_whole(tmp_path):
    out = tmp_path / "received.pt"
    mp.spawn(_message_worker, args=(_free_port(), str(out)), nprocs=2, join=True)
    assert torch.load(out, weights_only=True)["same"]
