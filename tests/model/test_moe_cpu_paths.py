"""XLA:CPU runs the routed experts one of two ways (`jlco.model.moe.Experts`): every
expert over the tokens (prefill), or only the chosen experts' weights (decode at small
batch). Both compute the same mixture as the grouped path the accelerators run."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlco.config import load_config
from jlco.model.moe import Experts, Router

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
