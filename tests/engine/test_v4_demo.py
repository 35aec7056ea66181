"""configs/deepseek_v4_tiny.py: the random-weight DeepSeek-V4 demo, built as
`jlco.generate` / `jlco.serve` build it without a checkpoint (`jlco.launch.load`).

Default tier: the config loads and covers every layer and MoE kind at sizes a few
hundred tokens exercise; the random model is chosen and built as for MLA (a random hash
table draws distinct experts); a V4 config too big to build falls back to this one's
model. Slow (~50 s on 2 CPU cores, five programs compiled): the engine's greedy tokens
(two requests batched, prompts past the window and past index_topk CSA entries) equal
`jlco.model.deepseek_v4.state` run directly. e2e: `python -m jlco.generate` (offload on
== off) and `python -m jlco.serve` on the config.
"""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import pytest

from jlco.config import Config, load_config
from jlco.model.deepseek_v4.config import LAYER_TYPES, MLP_LAYER_TYPES, V4Config

ROOT = pathlib.Path(__file__).resolve().parents[2]
V4_TINY = ROOT / "configs" / "deepseek_v4_tiny.py"
PROMPTS = [(45, 5), (70, 4)]          # (prompt length, new tokens)


def test_config_loads_with_every_layer_kind():
    cfg = load_config(V4_TINY)
    m = cfg.model
    assert cfg.is_v4 and isinstance(m, V4Config) and not cfg.cache.prefix_cache
    assert set(m.layer_types) == set(LAYER_TYPES)
    assert set(m.mlp_layer_types) == set(MLP_LAYER_TYPES)
    # at 256 tokens: past the window, several HCA entries, CSA selects among its entries
    assert m.sliding_window < 64 and 256 // m.compress_rate_hca >= 4
    assert m.index_topk < 256 // m.compress_rate_csa // 2
    assert cfg.engine.max_context_len <= m.max_position_embeddings


def test_random_choice_builds_the_v4_model():
    from flax import nnx

    from jlco.launch import load
    from jlco.model.deepseek_v4.moe import V4Router
    base = load_config(V4_TINY)
    choice = load.choose_model(None, base, None, 0)
    assert choice.model == base.model and choice.own_model and choice.checkpoint is None
    assert "RANDOM-WEIGHT" in choice.banner and "deepseek_v4_tiny" in choice.banner
    big = Config(model=V4Config(), cache=base.cache, engine=base.engine, name="flash")
    stand_in = load.random_choice(big, None, 0)
    assert not stand_in.own_model and "configs/deepseek_v4_tiny.py's model" in stand_in.banner
    assert stand_in.model.model_type == "deepseek_v4"
    assert stand_in.model.hidden_size == base.model.hidden_size
    router = V4Router(base.model, True, rngs=nnx.Rngs(3))
    table = np.asarray(router.tid2eid[...])
    m = base.model
    assert table.shape == (m.vocab_size, m.num_experts_per_tok)
    assert table.min() >= 0 and table.max() < m.n_routed_experts
    assert all(len(set(row)) == len(row) for row in table.tolist())   # distinct per token
    assert len({tuple(r) for r in table.tolist()}) > m.n_routed_experts   # not one route


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


@pytest.fixture(scope="module")
def built():
    from jlco.launch import load
    base = load_config(V4_TINY).replace(engine__max_context_len=128)
    choice = load.choose_model(None, base, None, 0)
    return load.load_sharded(choice, base, None, seed=0, verify=True)


def _direct(model, prompt: list[int], new: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and log-probs from `jlco.model.deepseek_v4.state` alone: the
    prompt prefilled in one chunk, then one decode step per token."""
    from flax import nnx

    from jlco.model.deepseek_v4 import state as v4_state
    logits, state = v4_state.prefill(model, np.asarray([prompt], np.int32), 128)
    last, toks, lps = logits[0, -1], [], []
    step = nnx.jit(v4_state.decode_step)
    for _ in range(new):
        lp = jax.nn.log_softmax(last)
        toks.append(int(np.argmax(lp)))
        lps.append(float(lp[toks[-1]]))
        out, state = step(model, state, np.asarray([toks[-1]], np.int32))
        last = out[0]
    return toks, lps


@pytest.mark.slow
def test_engine_greedy_equals_the_state_directly(built):
    from jlco.engine.core import Engine
    cfg, model = built
    engine = Engine(cfg, model)
    reqs = [engine.submit(_prompt(n, i), new) for i, (n, new) in enumerate(PROMPTS)]
    engine.run()
    engine.check_no_leaks()
    for i, (r, (n, new)) in enumerate(zip(reqs, PROMPTS)):
        want, want_lp = _direct(model, _prompt(n, i), new)
        assert list(r.tokens) == want, i
        np.testing.assert_allclose(r.logprobs, want_lp, atol=1e-4, err_msg=str(i))


# ----------------------------------------------------------------------------- e2e: CLIs


@pytest.mark.e2e
def test_generate_cli_runs_the_demo_config():
    from tests.support.cli import run
    outs = {}
    for flag in ("--nooffload", "--offload"):
        r = run("-m", "jlco.generate", "--config", str(V4_TINY), "--random_prompt", "64",
                "--max_new_tokens", "6", "--json", flag, env={"JAX_PLATFORMS": "cpu"})
        assert r.returncode == 0, r.stderr[-3000:]
        assert "RANDOM-WEIGHT" in r.stderr and "deepseek_v4_tiny" in r.stderr
        outs[flag] = json.loads(r.stdout)
    assert len(outs["--offload"]["tokens"]) == 6
    assert outs["--offload"]["tokens"] == outs["--nooffload"]["tokens"]
    assert outs["--offload"]["logprobs"] == outs["--nooffload"]["logprobs"]


@pytest.mark.e2e
def test_serve_cli_runs_the_demo_config():
    import httpx

    from tests.support.server import ServerProcess
    srv = ServerProcess("--config", str(V4_TINY))
    try:
        prompt = _prompt(40, 7)
        body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        r = httpx.post(f"{srv.url}/v1/completions", timeout=300, json=body)
        assert r.status_code == 200, r.text
        ids = r.json()["choices"][0]["token_ids"]
        assert len(ids) == 5
        with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=300,
                          json=dict(body, stream=True)) as s:
            streamed = [t for line in s.iter_lines() if line.startswith("data: {")
                        for t in json.loads(line[6:])["choices"][0].get("token_ids") or []]
        assert streamed == ids
        chat = httpx.post(f"{srv.url}/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
        assert chat.status_code == 200, chat.text
        assert "deepseek_v4" in srv.stderr and "RANDOM-WEIGHT" in srv.stderr
    finally:
        assert srv.stop() == 0
