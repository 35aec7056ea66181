"""GLM-5 IndexShare with the latent cache offloaded: a full layer and the shared layers
after it (which reuse its top-k) are one group, with one slot table, one miss plan and
one host→device transfer per step, on both fetch paths; the shared layers run no
indexer. Offload on equals offload off bit for bit, with a hot buffer at its minimum so
rows really miss and are evicted.

Counts are taken where each path does its work: the in-jit step is traced once (its
jaxpr is the whole step, so calls to the planner and the host gather while tracing are
the step's), the host-driven step is Python per layer (calls per decode step)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tests.support.engine_workload import BASE, make_prompts
from tests.support.engine_workload import run_workload as _run

from jlco.engine import allocation, host_driven
from jlco.engine import steps as engine_steps
from jlco.model.decoder import DeepseekV32
from jlco.model.indexer import Indexer
from jlco.offload import fetch, host_fetch, latent

PATTERN = ("full", "shared", "full", "shared")
GLM = BASE.replace(model=dataclasses.replace(
    BASE.model, model_type="glm_moe_dsa", num_hidden_layers=4, n_group=1, topk_group=1,
    indexer_types=PATTERN, rope_scaling=None, num_nextn_predict_layers=0))
# hot_buffer_rows 0: the minimum (index_topk rows), so steps miss and evict.
OFF = GLM.replace(cache__offload=True, cache__page_size=16, cache__hot_buffer_rows=0,
                  cache__fetch_chunk_rows=0)
FULL_LAYERS = PATTERN.count("full")


@pytest.fixture(scope="module")
def glm_model():
    return DeepseekV32(GLM.model, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def glm_prompts():
    return make_prompts()


def _counting(monkeypatch, module, name, counts, key):
    real = getattr(module, name)

    def wrapper(*a, **kw):
        counts[key] = counts.get(key, 0) + 1
        return real(*a, **kw)
    monkeypatch.setattr(module, name, wrapper)
    return real


def test_groups_share_one_slot_table():
    cache, _ = allocation.allocate_cache(OFF.replace(cache__fetch_path="in_jit"))
    lat = cache.latent
    assert lat.groups == (0, 0, 1, 1)
    assert lat.slot_pos.shape[0] == lat.slot_stamp.shape[0] == lat.slot_pref.shape[0] \
        == FULL_LAYERS
    assert lat.rows.shape[0] == 4                                   # rows stay per layer
    assert latent.table_groups(lat) == ((0, 1), (2, 3))
    assert latent.share_groups([False, True, True, False, True, False]) == (0, 0, 0, 1, 1, 2)
    with pytest.raises(ValueError, match="layer 0"):
        latent.share_groups([True, False])
    # the planner counts the same slot tables (one per indexer layer)
    from jlco.planning import memory
    deepseek = OFF.replace(model__indexer_types=None)
    saved = (memory.per_request_bytes(deepseek, 160, True)["tables"]
             - memory.per_request_bytes(OFF, 160, True)["tables"])
    assert saved == 2 * 9 * OFF.hot_buffer_rows     # int32 position + stamp, bool prefetched


def test_in_jit_step_plans_and_fetches_once_per_group(glm_model, monkeypatch):
    """One traced decode step: `resolve_selection` (the miss plan) and the host gather
    (each call one device_put of [layers, n, R]) run once per full layer, not per
    layer, and the indexer projects and selects in full layers only."""
    cfg = OFF.replace(cache__fetch_path="in_jit")
    cache, _ = allocation.allocate_cache(cfg)
    counts = {}
    _counting(monkeypatch, latent, "resolve_selection", counts, "plans")
    real_gather = fetch.gather_host_rows
    shapes = []

    def gather(host_layer, ids):
        counts["transfers"] = counts.get("transfers", 0) + 1
        out = real_gather(host_layer, ids)
        shapes.append(out.shape)
        return out
    monkeypatch.setattr(fetch, "gather_host_rows", gather)
    _counting(monkeypatch, Indexer, "project", counts, "indexer_project")
    _counting(monkeypatch, Indexer, "topk", counts, "indexer_topk")
    g, s = nnx.split(glm_model)
    b = cfg.engine.max_batch_size
    tokens, active = jnp.zeros((b, 1), jnp.int32), jnp.ones((b,), bool)
    jax.make_jaxpr(lambda st, c: engine_steps.forward(g, st, c, tokens, active, impl="xla"))(
        s, cache)
    assert counts == {"plans": FULL_LAYERS, "transfers": FULL_LAYERS,
                      "indexer_project": FULL_LAYERS, "indexer_topk": FULL_LAYERS}, counts
    rb, m = cfg.row_bytes, cfg.hot_buffer_rows
    assert all(sh[0] == 2 and sh[-1] == rb for sh in shapes), shapes   # both layers at once
    assert all(sh[1] == b * m for sh in shapes), shapes


# the slow tier (pyproject.toml): the in-jit path's count test and the host-driven
# equality test (test_in_jit_offload_equals_off_and_host_driven) stay in the default one
@pytest.mark.slow
def test_host_driven_step_plans_and_fetches_once_per_group(glm_model, glm_prompts,
                                                           monkeypatch):
    """Per decode step of the host-driven engine: one miss list back and at most one
    transfer per micro-batch per group (full layer), each carrying both layers' rows;
    bit-equal to offload off and to the in-jit path, with rows really missing."""
    counts, groups = {"steps": 0}, []
    _counting(monkeypatch, host_driven.HostDriven, "decode_step", counts, "steps")
    real_fetch = host_fetch.HostFetcher.fetch

    def fetch_(self, rows, layer, miss_ids, dest):
        counts["plans"] = counts.get("plans", 0) + 1
        groups.append(layer)
        return real_fetch(self, rows, layer, miss_ids, dest)
    monkeypatch.setattr(host_fetch.HostFetcher, "fetch", fetch_)
    real_scatter = host_fetch._scatter

    def scatter(rows, layers, dest, data):
        counts["transfers"] = counts.get("transfers", 0) + 1
        assert data.shape[0] == layers.shape[0] == 2
        return real_scatter(rows, layers, dest, data)
    monkeypatch.setattr(host_fetch, "_scatter", scatter)
    eng, got = _run(OFF.replace(cache__fetch_path="host_driven"), glm_model, glm_prompts)
    _, want = _run(GLM, glm_model, glm_prompts)
    assert got == want
    micro = len(host_driven.micro_batches(OFF.engine.max_batch_size))
    # admission warm-ups send per group too (counted as transfers, not as plans)
    assert counts["plans"] == counts["steps"] * FULL_LAYERS * micro > 0, counts
    assert set(groups) == {(0, 1), (2, 3)}
    assert 0 < counts["transfers"] <= counts["plans"] + 2 * FULL_LAYERS * 4, counts
    per = eng.metrics.snapshot()["per_layer"]
    for k in ("lookups", "hits", "misses", "h2d_moved_rows"):
        assert per[k][1] == per[k][0] and per[k][3] == per[k][2], (k, per[k])
    assert per["misses"][0] > 0 and per["misses"][2] > 0


# the slow tier (pyproject.toml); the default one keeps IndexShare offloaded on both fetch
# paths against transformers (test_glm_checkpoint.py, "sharded" and "fp8")
@pytest.mark.slow
def test_in_jit_offload_equals_off_and_host_driven(glm_model, glm_prompts):
    """Offload on (in-jit, one chunked and one padded transfer per group) equals offload
    off bit for bit, and its counters equal the host-driven path's."""
    _, want = _run(GLM, glm_model, glm_prompts)
    for chunk in (0, 8):
        eng, got = _run(OFF.replace(cache__fetch_path="in_jit", cache__fetch_chunk_rows=chunk),
                        glm_model, glm_prompts)
        assert got == want, chunk
        per = eng.metrics.snapshot()["per_layer"]
        assert per["misses"][0] == per["misses"][1] > 0
        assert np.asarray(per["lookups"]).min() > 0
