"""Hit/miss split attention (`cache.split_attention`, host-driven path): the resident
rows are attended while the misses transfer, the fetched ones after, the two merged by
log-sum-exp. Greedy tokens equal the unsplit engine's and transformers' own on the parity
checkpoints (DeepSeek-V3.2 and GLM-5 IndexShare, f32), log-probs within f32 rounding;
the in-jit path refuses the knob."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from tests.support.engine_workload import BASE, make_model, make_prompts, run_workload
from tests.support.hf_reference import build_hf_model, hf_tensors, t2n

from jlco.checkpoint.hf_names import model_from_hf
from jlco.config import ConfigError
from jlco.engine.core import Engine

HOST = BASE.replace(cache__offload=True, cache__fetch_path="host_driven",
                    cache__kv_format="f32")
GLM = dataclasses.replace(
    BASE.model, model_type="glm_moe_dsa", num_hidden_layers=4, n_group=1, topk_group=1,
    mlp_layer_types=("dense", "sparse", "dense", "sparse"),
    indexer_types=("full", "shared", "shared", "full"), rope_scaling=None,
    rms_norm_eps=1e-5, num_nextn_predict_layers=0)    # tests/model/test_parity_glm.py's
# f32 rounding: the merge re-associates each query's softmax sum (tests/offload/
# test_lse_merge.py bounds the attention output at 2e-6); through the layers the
# log-probs move by ~1e-6 at most, so 1e-5 is a margin and a wrong merge moves them by 1e-2.
LOGPROB_ATOL = 1e-5


def test_the_in_jit_path_refuses_split_attention():
    with pytest.raises(ConfigError, match="cache.split_attention.*host-driven"):
        BASE.replace(cache__offload=True, cache__fetch_path="in_jit",
                     cache__split_attention=True)
    with pytest.raises(ConfigError, match="cache.split_attention"):
        BASE.replace(cache__split_attention=True)                 # offload off
    assert BASE.replace(cache__offload=True, cache__storage="file", cache__storage_path="/tmp",
                        cache__split_attention=True).cache.split_attention


@pytest.mark.slow
def test_split_equals_unsplit_on_the_engine_workload():
    """Slots reused, prompts past index_topk (steps with hits and misses together)."""
    model, prompts = make_model(), make_prompts()
    _, off = run_workload(HOST, model, prompts)
    eng, on = run_workload(HOST.replace(cache__split_attention=True), model, prompts)
    assert eng.metrics.health()["total"]["rows_on_demand"] > 0     # the split did split
    for (tok_a, lp_a), (tok_b, lp_b) in zip(off, on):
        assert tok_a == tok_b
        np.testing.assert_allclose(lp_b, lp_a, atol=LOGPROB_ATOL, rtol=0)


def _hf_greedy(ref, prompt, n):
    with torch.no_grad():
        g = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         pad_token_id=0, eos_token_id=None, return_dict_in_generate=True)
    return [int(t) for t in t2n(g.sequences[0, len(prompt):])]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v32", "glm_index_share"])
def test_split_tokens_equal_transformers_on_the_parity_checkpoints(family):
    """The parity tests' checkpoints (transformers-initialised, f32), prompts of 20 and
    48 tokens around index_topk 32, 12 greedy tokens: split on == split off == HF."""
    m = BASE.model if family == "deepseek_v32" else GLM
    ref = build_hf_model(m, seed=0, init_std=0.1, bias_std=0.05)
    model = model_from_hf(m, hf_tensors(ref), mtp=False)
    cfg = HOST.replace(model=m).replace(model__num_nextn_predict_layers=0)
    rng = np.random.RandomState(1)
    prompts = [list(map(int, rng.randint(0, m.vocab_size, n))) for n in (20, 48)]
    want = [_hf_greedy(ref, p, 12) for p in prompts]
    got = {}
    for split in (False, True):
        eng = Engine(cfg.replace(cache__split_attention=split), model)
        reqs = eng.generate(prompts, 12)
        got[split] = [r.tokens for r in reqs]
        assert eng.metrics.health()["total"]["rows_on_demand"] > 0
    assert got[True] == got[False] == want
