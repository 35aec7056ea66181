"""The planner's largest batch agrees with what the engine actually allocates and admits.

Three layers of agreement, on the tiny CPU config:
1. `engine.device_cache_bytes` (abstract shapes of `allocate_cache`) equals the bytes of
   a real engine's cache arrays whose memory kind is 'device'.
2. Per batch slot, those bytes equal the planner's cache part exactly
   (`per_request_bytes`: indexer + latent_device + tables), over cache formats.
3. For a device budget, `plan.max_batch` equals `engine.batch_for_budget`, and an engine
   sized that way admits exactly that many requests.
Weights are compared exactly too (planner f32 bytes == the model's state). Activations
differ by design: the engine allocates none up front (XLA owns step temporaries), so
the planner's per-request activation estimate is passed to the engine side as given.
The engine's batch-independent bytes (offload step counter and stats, ~100 B) are
subtracted by the engine side only; the budgets are far from a batch boundary.
"""
import jax
import numpy as np
import pytest
from flax import nnx

from jlco.config import load_config
from jlco.engine import allocation as engine
from jlco.engine.core import Engine
from jlco.model.decoder import DeepseekV32
from jlco.planning import memory as plan

TINY = load_config("configs/tiny.py")
BUDGETS = (8e6, 20e6)   # device bytes: weights 2.6 MB + a few requests


def _by_kind(tree) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in jax.tree.leaves(tree):
        kind = x.sharding.memory_kind
        out[kind] = out.get(kind, 0) + x.nbytes
    return out


@pytest.fixture(scope="module")
def model():
    return DeepseekV32(TINY.model, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("offload", [False, True])
def test_abstract_accounting_equals_real_allocation(model, offload):
    cfg = TINY.replace(cache__offload=offload, cache__hot_buffer_rows=64,
                       engine__max_batch_size=3)
    eng = Engine(cfg, model, impl="xla")
    kinds = _by_kind(eng.runner.cache)
    assert kinds["device"] == engine.device_cache_bytes(cfg, 3)
    layers, rows = plan.cache_layers(cfg), 3 * cfg.engine.max_context_len
    assert kinds.get("pinned_host", 0) == (layers * rows * cfg.row_bytes if offload else 0)


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("formats", [
    dict(),                                                        # f32 rows, f32 keys
    dict(cache__kv_format="fp8", cache__indexer_key_format="fp8"),
    dict(cache__kv_format="bf16", model__dtype="bfloat16"),        # keys stored as bf16 bits
    dict(engine__num_draft_tokens=1, cache__hot_buffer_rows=80),  # s_q 2: MTP layer, 2k min
])
def test_cache_bytes_per_slot_match_planner_exactly(offload, formats):
    cfg = TINY.replace(cache__offload=offload, **formats)
    per_slot = engine.device_cache_bytes(cfg, 2) - engine.device_cache_bytes(cfg, 1)
    pr = plan.per_request_bytes(cfg, cfg.engine.max_context_len, offload)
    assert per_slot == pr["indexer"] + pr["latent_device"] + pr["tables"]
    if offload:   # the hot buffer, not the context, sets the latent device bytes
        assert pr["latent_device"] == plan.cache_layers(cfg) * cfg.hot_buffer_rows * cfg.row_bytes


def test_weights_match_planner_exactly(model):
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    assert state_bytes == plan.weight_bytes(TINY.model, weight_format="f32").total


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("budget", BUDGETS)
def test_planner_batch_equals_engine_batch(model, offload, budget):
    cfg = TINY.replace(cache__offload=offload)
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    act = plan.per_request_bytes(cfg, cfg.engine.max_context_len, offload)["activations"]
    planned = plan.max_batch(cfg, budget, offload=offload, weight_format="f32")
    admitted = engine.batch_for_budget(cfg, budget, other_bytes=weights,
                                       other_bytes_per_slot=act)
    assert planned == admitted > 0
    # the engine's real allocation at that batch fits the budget; one more slot does not
    fits = lambda b: weights + engine.device_cache_bytes(cfg, b) + b * act <= budget  # noqa: E731
    assert fits(admitted) and not fits(admitted + 1)


@pytest.mark.slow   # long on 2 CPU cores: the slow tier (pyproject.toml)
def test_offload_admits_more_and_engine_admits_the_planned_batch(model):
    budget = BUDGETS[0]
    batches = {off: plan.max_batch(TINY, budget, offload=off, weight_format="f32")
               for off in (False, True)}
    assert batches[True] > 3 * batches[False]
    cfg = TINY.replace(cache__offload=True, engine__max_batch_size=batches[True])
    eng = Engine(cfg, model, impl="xla")
    rng = np.random.default_rng(0)
    reqs = [eng.submit(rng.integers(0, 512, 24).tolist(), 4) for _ in range(batches[True] + 2)]
    eng.step()
    running = [r for r in reqs if r.status == "running"]
    assert len(running) == batches[True] and len(eng.scheduler.waiting) == 2
    assert _by_kind(eng.runner.cache)["device"] == engine.device_cache_bytes(cfg, batches[True])
    eng.run()
    assert all(r.status == "finished" and len(r.tokens) == 4 for r in reqs)
    eng.check_no_leaks()
