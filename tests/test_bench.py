"""bench.py quality's teacher forcing against HF transformers' full forward on a tiny model."""

from __future__ import annotations

import pytest
import torch

from bench import teacher_forced_logprobs
from engine import LLM
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
