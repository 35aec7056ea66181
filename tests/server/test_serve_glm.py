"""`python -m jlco.serve --checkpoint` on a GLM-5 (`glm_moe_dsa`) checkpoint written by
transformers (IndexShare layers full / shared / shared / full, sharded, float32): token-id
completions give GlmMoeDsaForCausalLM's greedy tokens and log-probs within 1e-4, offload
on, streamed and whole alike; /v1/models names the served model."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import httpx
import numpy as np
import pytest
from tests.support.cli import tiny_model_config
from tests.support.server import ServerProcess

pytestmark = pytest.mark.e2e   # real subprocesses: the e2e tier (pyproject.toml)

torch = pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).resolve().parents[2]
NEW = 6
PROMPTS = [[int(t) for t in np.random.RandomState(4).randint(0, 512, n)] for n in (40, 9)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tests.support.hf_reference import build_hf_model
    m = dataclasses.replace(
        tiny_model_config(), model_type="glm_moe_dsa", num_hidden_layers=4, n_group=1,
        topk_group=1, indexer_types=("full", "shared", "shared", "full"), rope_scaling=None,
        rms_norm_eps=1e-5, num_nextn_predict_layers=0)
    ref = build_hf_model(m, seed=5, init_std=0.1, bias_std=0.05)
    d = tmp_path_factory.mktemp("glm") / "ckpt"
    ref.save_pretrained(d, max_shard_size="150KB")
    srv = ServerProcess("--config", str(ROOT / "configs" / "tiny.py"), "--checkpoint", str(d),
                        "--offload", "--override", "engine.max_context_len=256")
    yield srv, ref
    assert srv.stop() == 0


def _reference(ref, prompt):
    """Greedy continuation by transformers' full forward at every step (no KV cache):
    its cached `generate` parts from its own uncached forward on some GLM IndexShare
    models (docs/journal/2026-12-02.md, session 8), the forward is the definition."""
    toks, lps = [], []
    with torch.no_grad():
        for _ in range(NEW):
            lp = torch.log_softmax(ref(torch.tensor([prompt + toks])).logits[0, -1].double(), -1)
            toks.append(int(torch.argmax(lp)))
            lps.append(float(lp[toks[-1]]))
    return toks, lps


def test_served_glm_equals_transformers(served):
    srv, ref = served
    for prompt in PROMPTS:
        want, want_lp = _reference(ref, prompt)
        r = httpx.post(f"{srv.url}/v1/completions", timeout=300, json={
            "prompt": prompt, "max_tokens": NEW, "temperature": 0, "logprobs": 0,
            "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["token_ids"] == want
        np.testing.assert_allclose(c["logprobs"]["token_logprobs"], want_lp, atol=1e-4)
        with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=300, json={
                "prompt": prompt, "max_tokens": NEW, "temperature": 0, "stream": True,
                "ignore_eos": True, "return_token_ids": True}) as s:
            ids = [t for line in s.iter_lines() if line.startswith("data: {")
                   for t in json.loads(line[6:])["choices"][0].get("token_ids") or []]
        assert ids == want
    assert httpx.get(f"{srv.url}/v1/models", timeout=30).status_code == 200
