"""GLM-5 (`glm_moe_dsa`) checkpoints saved by transformers, loaded as `jlco.generate` loads
them (`load_model`, then the engine), against transformers' own greedy decode:

- an IndexShare model (layers full / shared / shared / full) as one file, sharded, and
  as fp8 128x128 blocks (its reference: the dequantised twin loaded by transformers);
  an all-full one as one file. Greedy tokens equal, f32 log-probs within 1e-4, and the
  engine with the latent cache offloaded gives exactly the tokens and log-probs of the
  engine without (bit for bit), on one device, with both fetch paths;
- config.json as transformers' GlmMoeDsaConfig reads it: indexer_types, or the
  index_topk_pattern / index_topk_freq / index_skip_topk_offset keys;
- a model_type jlco does not implement is refused, naming it and the allowed values;
  a shared layer carrying indexer tensors is refused too (it has none).
"""

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from tests.support.checkpoint import fp8_tool
from tests.support.cli import MPE
from tests.support.hf_reference import build_hf_model

from jlco.checkpoint.load import CheckpointError, load_model, open_hf_checkpoint, read_hf_config
from jlco.config import load_config
from jlco.engine.core import Engine

BASE = load_config("configs/tiny.py").replace(
    engine__attention_impl="xla", engine__max_batch_size=2, engine__max_context_len=128)
SHARED = ("full", "shared", "shared", "full")
GLM = dataclasses.replace(
    BASE.model, model_type="glm_moe_dsa", num_hidden_layers=4, n_group=1, topk_group=1,
    first_k_dense_replace=1, indexer_types=SHARED, rope_scaling=None, rms_norm_eps=1e-5,
    num_nextn_predict_layers=0, max_position_embeddings=MPE)
PROMPTS = [[int(t) for t in np.random.RandomState(1).randint(0, 512, n)] for n in (48, 20)]
NEW = 8


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{name: (checkpoint dir, the transformers model that is its reference)}."""
    root = tmp_path_factory.mktemp("glm")
    share = build_hf_model(GLM, seed=0, init_std=0.1, bias_std=0.05)
    share.save_pretrained(root / "single")
    share.save_pretrained(root / "sharded", max_shard_size="150KB")
    fp8_tool().make_fp8_checkpoint(root / "sharded", root / "fp8", twin=root / "twin")
    from transformers import GlmMoeDsaForCausalLM
    twin = GlmMoeDsaForCausalLM.from_pretrained(root / "twin", dtype=torch.float32).eval()
    full = build_hf_model(dataclasses.replace(GLM, indexer_types=None), seed=1, init_std=0.1,
                          bias_std=0.05)
    full.save_pretrained(root / "all_full")
    return {"single": (root / "single", share), "sharded": (root / "sharded", share),
            "fp8": (root / "fp8", twin), "all_full": (root / "all_full", full)}


def _reference(ref, prompt):
    with torch.no_grad():
        g = ref.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                         eos_token_id=None)
    toks = g.sequences[0, len(prompt):].tolist()
    return toks, np.array([float(torch.log_softmax(x[0].float(), -1)[t])
                           for x, t in zip(g.logits, toks)])


def _generate(path, **cache):
    mcfg, model, info = load_model(path, {"dtype": "float32"}, progress=False)
    eng = Engine(BASE.replace(model=mcfg, **{f"cache__{k}": v for k, v in cache.items()}),
                 model)
    reqs = [eng.submit(p, NEW) for p in PROMPTS]
    eng.run()
    eng.check_no_leaks()
    return mcfg, [(r.tokens, r.logprobs) for r in reqs]


# sharded (both fetch paths) and fp8 by default; one file and all-full as slow tests (the
# loader's one-file path and the all-full model are covered elsewhere too).
@pytest.mark.parametrize("name", [pytest.param("single", marks=pytest.mark.slow), "sharded",
                                  "fp8", pytest.param("all_full", marks=pytest.mark.slow)])
def test_engine_equals_transformers_offload_on_and_off(ckpts, name):
    path, ref = ckpts[name]
    mcfg, off = _generate(path)
    assert mcfg.model_type == "glm_moe_dsa"
    assert mcfg.indexer_types == (None if name == "all_full" else SHARED)
    for (toks, lps), prompt in zip(off, PROMPTS):
        want_toks, want_lps = _reference(ref, prompt)
        assert toks == want_toks, (name, prompt[:4])
        np.testing.assert_allclose(lps, want_lps, atol=1e-4, rtol=0)
    paths = ("in_jit", "host_driven") if name == "sharded" else ("in_jit",)
    for fetch in paths:
        _, on = _generate(path, offload=True, fetch_path=fetch, page_size=16)
        assert on == off, (name, fetch)       # exact: the same bytes reach attention


def test_config_json_as_transformers_reads_it(ckpts, tmp_path):
    from transformers import GlmMoeDsaConfig
    src = ckpts["single"][0]
    d = json.loads((src / "config.json").read_text())
    assert read_hf_config(src).indexer_types == SHARED
    assert read_hf_config(src).mlp_layer_types is None   # first_k_dense_replace's rule
    cases = [{"index_topk_pattern": "FSSF"}, {"index_topk_pattern": ["full", "shared",
                                                                    "full", "full"]},
             {"index_topk_freq": 2, "index_skip_topk_offset": 1},
             {"index_topk_freq": 3}, {}]
    for keys in cases:
        e = {k: v for k, v in d.items() if k != "indexer_types"} | keys
        want = GlmMoeDsaConfig(**e).indexer_types
        shutil.copytree(src, tmp_path / "c", dirs_exist_ok=True)
        (tmp_path / "c" / "config.json").write_text(json.dumps(e))
        got = read_hf_config(tmp_path / "c").indexer_types
        assert (got or ("full",) * 4) == tuple(want), keys


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v3", None])
def test_unknown_model_type_is_refused(ckpts, tmp_path, model_type):
    d = tmp_path / "c"
    shutil.copytree(ckpts["single"][0], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = model_type
    if model_type is None:
        del cfg["model_type"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model_type.*'deepseek_v32', 'glm_moe_dsa'"):
        open_hf_checkpoint(d)


def test_shared_layer_with_indexer_tensors_is_refused(ckpts, tmp_path):
    """Marking a full layer shared leaves its indexer tensors unknown: refused by name."""
    d = tmp_path / "c"
    shutil.copytree(ckpts["single"][0], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["indexer_types"] = ["full", "shared", "shared", "shared"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"unknown tensor 'model\.layers\.3\.self_attn"
                                              r"\.indexer\."):
        open_hf_checkpoint(d)


def test_layer_patterns_survive_the_orbax_manifest():
    """A converted checkpoint's manifest stores the config as JSON (tuples become lists):
    read back, it is the same config."""
    from jlco.checkpoint.load import _config_from_json, _config_to_json
    for m in (GLM, dataclasses.replace(GLM, mlp_layer_types=("dense", "sparse", "dense",
                                                             "sparse"))):
        d = json.loads(json.dumps(_config_to_json(m)))
        assert isinstance(d["indexer_types"], list)
        assert _config_from_json(d, "manifest") == m


def test_deepseek_config_reads_as_before(ckpts):
    """transformers writes mlp_layer_types for DeepseekV32 too; the first_k_dense_replace
    pattern reads as None (no pattern), and deepseek_v32 takes no GLM defaults."""
    from jlco.config import ModelConfig
    d = json.loads((ckpts["single"][0] / "config.json").read_text())
    d = {k: v for k, v in d.items() if k != "indexer_types"} | {
        "model_type": "deepseek_v32", "n_group": 4, "topk_group": 2}
    m = ModelConfig.from_hf_dict(d)
    assert (m.model_type, m.mlp_layer_types, m.indexer_types) == ("deepseek_v32", None, None)
    assert not m.indexer_rope_interleaved and (m.n_group, m.topk_group) == (4, 2)
    m = ModelConfig.from_hf_dict(d | {"mlp_layer_types": ["dense", "sparse", "dense", "sparse"]})
    assert [m.is_moe_layer(i) for i in range(5)] == [False, True, False, True, True]
