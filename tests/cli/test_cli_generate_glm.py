"""`python -m jlco.generate` on a GLM-5 (`glm_moe_dsa`) checkpoint written by transformers,
as a user runs it: an IndexShare model (layers full / shared / shared / full), sharded,
float32. Greedy tokens equal transformers' GlmMoeDsaForCausalLM and log-probs are within
1e-4, with the latent cache offloaded; offload off gives the same bits (slow), and so do
the meshes expert=2 and data=2 up to tests/parallel/test_mesh.py's LOGPROB_ATOL (slow:
subprocesses with 2 CPU devices).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from tests.support.cli import run, tiny_model_config

torch = pytest.importorskip("torch")

NEW = 6
PROMPTS = [[int(t) for t in np.random.RandomState(3).randint(0, 512, n)] for n in (45, 12)]
MESH_ATOL = 1e-5     # tests/parallel/test_mesh.py LOGPROB_ATOL: summation order only


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(checkpoint dir, prompts file, transformers reference)."""
    from tests.support.hf_reference import build_hf_model
    m = dataclasses.replace(
        tiny_model_config(), model_type="glm_moe_dsa", num_hidden_layers=4, n_group=1,
        topk_group=1, indexer_types=("full", "shared", "shared", "full"), rope_scaling=None,
        rms_norm_eps=1e-5, num_nextn_predict_layers=0)
    ref = build_hf_model(m, seed=2, init_std=0.1, bias_std=0.05)
    d = tmp_path_factory.mktemp("glm")
    ref.save_pretrained(d / "ckpt", max_shard_size="150KB")
    assert len(list((d / "ckpt").glob("*.safetensors"))) > 1
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return d / "ckpt", prompts, ref


def _generate(ckpt, *extra: str, devices: int = 1) -> dict:
    path, prompts, _ = ckpt
    env = {"JAX_PLATFORMS": "cpu"}
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    r = run("-m", "jlco.generate", "--checkpoint", str(path), "--prompts_file", str(prompts),
            "--max_new_tokens", str(NEW), "--impl", "xla", "--json", *extra, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def _reference(ref, prompt):
    with torch.no_grad():
        g = ref.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                         eos_token_id=None)
    toks = g.sequences[0, len(prompt):].tolist()
    return toks, np.array([float(torch.log_softmax(x[0].float(), -1)[t])
                           for x, t in zip(g.logits, toks)])


@pytest.fixture(scope="module")
def offloaded(ckpt):
    return _generate(ckpt, "--offload")


@pytest.mark.e2e
def test_generate_offloaded_equals_transformers(ckpt, offloaded):
    for got, prompt in zip(offloaded["results"], PROMPTS, strict=True):
        want_toks, want_lps = _reference(ckpt[2], prompt)
        assert got["tokens"] == want_toks
        np.testing.assert_allclose(got["logprobs"], want_lps, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_generate_offload_off_is_bit_equal(ckpt, offloaded):
    assert _generate(ckpt, "--nooffload")["results"] == offloaded["results"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["expert=2", "data=2"])
def test_mesh_equals_one_device(ckpt, offloaded, mesh):
    got = _generate(ckpt, "--offload", "--mesh", mesh, devices=2)
    for g, f in zip(got["results"], offloaded["results"], strict=True):
        assert g["tokens"] == f["tokens"]
        np.testing.assert_allclose(g["logprobs"], f["logprobs"], rtol=0, atol=MESH_ATOL)
