"""XLA:CPU runs the routed experts one of two ways (`jlco.model.moe.Experts`): every
expert over the tokens (prefill), or only the chosen experts' weights (decode at small
batch), from the stacked weights or, in the engine (`unstack_experts`), from each expert's
own arrays. All compute the same mixture as the grouped path the accelerators run."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tests.support.decode_hlo import compiled_decode_step

from jlco.config import load_config
from jlco.model.decoder import DeepseekV32
from jlco.model.moe import Experts, Router, unstack_experts

CFG = dataclasses.replace(load_config("configs/tiny.py").model, n_routed_experts=16,
                          num_experts_per_tok=2, n_group=1, topk_group=1)


def _inputs(n: int):
    router, experts = Router(CFG, rngs=nnx.Rngs(1)), Experts(CFG, rngs=nnx.Rngs(2))
    x = jax.random.normal(jax.random.PRNGKey(n), (n, CFG.hidden_size), jnp.float32)
    w, ids = router(x)
    return experts, x, w, ids


def test_picked_experts_equal_dense_and_grouped_at_decode_batch():
    experts, x, w, ids = _inputs(n=3)          # 6 assignments ≤ 16 / 2: the picked path
    picked, dense, grouped = experts._picked(x, w, ids), experts._dense(x, w, ids), \
        experts._grouped(x, w, ids)
    np.testing.assert_allclose(picked, dense, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(picked, grouped, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(experts(x, w, ids), picked)


def test_many_tokens_run_every_expert():
    experts, x, w, ids = _inputs(n=9)          # 18 assignments > 8: every expert runs
    np.testing.assert_array_equal(experts(x, w, ids), experts._dense(x, w, ids))
    np.testing.assert_allclose(experts._picked(x, w, ids), experts._dense(x, w, ids),
                               rtol=1e-5, atol=1e-6)


def _unstacked(experts):
    split = nnx.clone(experts)
    split.unstack()
    return split


def test_unstack_keeps_every_expert_and_is_idempotent():
    experts, *_ = _inputs(n=1)
    split = _unstacked(experts)
    assert split.per_expert and not experts.per_expert and split.num_experts == 16
    gate, up, down = (getattr(experts, p)[...] for p in ("gate_proj", "up_proj", "down_proj"))
    gate_up, parts = split.gate_proj.get_value(), split.down_proj.get_value()
    assert split.up_proj is None and len(gate_up) == len(parts) == 16
    for e in range(16):     # gate | up of each expert side by side, down as it was
        np.testing.assert_array_equal(gate_up[e], np.concatenate([gate[e], up[e]], axis=1))
        np.testing.assert_array_equal(parts[e], down[e])
    split.unstack()
    assert len(split.gate_proj.get_value()) == 16


@pytest.mark.parametrize("n", [1, 3, 8])
def test_per_expert_switch_equals_the_stacked_paths(n):
    experts, x, w, ids = _inputs(n=n)              # n·k <= 16: one switch per assignment
    split = _unstacked(experts)
    out = jax.jit(lambda x, w, ids: split(x, w, ids))(x, w, ids)
    np.testing.assert_array_equal(split(x, w, ids), split._switched(x, w, ids))
    np.testing.assert_allclose(out, experts._dense(x, w, ids), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, experts._grouped(x, w, ids), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [9, 40, 300])
def test_per_expert_many_tokens_run_in_expert_tiles(n):
    experts, x, w, ids = _inputs(n=n)              # n·k > 16 assignments
    split = _unstacked(experts)
    out = jax.jit(lambda x, w, ids: split(x, w, ids))(x, w, ids)
    np.testing.assert_array_equal(split(x, w, ids), split._tiled(x, w, ids))
    np.testing.assert_allclose(out, experts._dense(x, w, ids), rtol=1e-5, atol=1e-6)
    # Experts nobody chose, and one expert taking most rows (many tiles of one expert,
    # tiles ending mid-way), change nothing else.
    few = jnp.where(ids < 4, 5, ids)
    np.testing.assert_allclose(split._tiled(x, w, few), experts._dense(x, w, few),
                               rtol=1e-5, atol=1e-6)


def test_unstack_experts_walks_the_model():
    cfg = load_config("configs/tiny.py").model
    model = DeepseekV32(cfg, rngs=nnx.Rngs(0))
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) \
        + cfg.num_nextn_predict_layers      # the MTP block is an MoE block too
    assert unstack_experts(model) == n_moe > 0
    assert unstack_experts(model) == 0


@pytest.mark.parametrize("batch", [1, 4])
def test_cpu_decode_step_copies_no_expert_weights(batch):
    # Picked from the stacked [E, d, i] weights, XLA:CPU copied each chosen expert
    # before its matmul (a slice is never read in place): 1.4-2.2 ms a layer at batch 4.
    cfg, _, hlo = compiled_decode_step(batch, 256)
    slices = [ln for ln in hlo.splitlines() if "/experts/" in ln
              and ("slice(" in ln or "slice_" in ln.split("=")[0] or "gather" in ln)
              and "%d,%d]" % (cfg.model.hidden_size, cfg.model.moe_intermediate_size) in ln]
    assert "/experts/" in hlo and not slices, slices[:3]
