"""Layer-ahead prefetch (`cache.prefetch_ahead`, host-driven path): while layer L
computes, layer L+1's indexer scores L's input, the predicted rows that are not resident
are fetched into the hot buffer flagged as prefetched, and L+1's real top-k fetches only
what the prediction missed. Exact by construction: tokens and log-probs equal prefetch
off bit for bit; per layer and step rows_needed = rows_hit + rows_prefetched_used +
rows_on_demand; the prediction's accuracy is counted (rows_predicted(_correct)); an
IndexShare group is predicted at its full layer only; the in-jit path refuses it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tests.support.engine_workload import BASE, make_model, make_prompts, run_workload

from jlco.config import ConfigError
from jlco.engine.core import Engine
from jlco.engine.runner import record_stats
from jlco.model.decoder import DeepseekV32
from jlco.offload import latent
from jlco.offload.metrics import OffloadMetrics

HOST = BASE.replace(cache__offload=True, cache__fetch_path="host_driven",
                    cache__kv_format="f32")
KEYS = ("rows_needed", "rows_hit", "rows_prefetched_used", "rows_on_demand")


def _lat(slot_pos, stamp, pref=None, step=5):
    slot_pos = jnp.asarray(slot_pos, jnp.int32)[None]
    g, b, m = slot_pos.shape
    return latent.OffloadLatent(
        rows=jnp.zeros((1, b, m, 4), jnp.uint8), slot_pos=slot_pos,
        slot_stamp=jnp.asarray(stamp, jnp.int32)[None],
        slot_pref=jnp.zeros((1, b, m), bool) if pref is None else jnp.asarray(pref)[None],
        host=(), page_table=jnp.zeros((b, 4), jnp.int32), step=jnp.int32(step),
        stats=jnp.zeros((1, len(latent.STAT_NAMES)), jnp.int32), policy="lru", page_size=8,
        chunk_rows=0)


def test_plan_prefetch_by_hand():
    """4 slots holding positions 3, 7, 9 (stamps 1, 4, 2) and one empty; a loaded-ahead
    row sits in slot 2. Predicted {7, 11, 12}: 7 is resident (kept, its stamp unchanged),
    11 and 12 get the empty slot 3 and then the oldest, slot 0 (position 3, stamp 1);
    both victims are flagged and stamped with the step; the prediction counts 3."""
    lat = _lat([[3, 7, 9, -1]], [[1, 4, 2, 0]], pref=[[False, False, True, False]])
    # jitted as the engine runs them (op by op these small programs take ~10 s to compile)
    plan = jax.jit(latent.plan_prefetch, static_argnums=1)
    resolve = jax.jit(latent.resolve_selection, static_argnums=1)
    new, res = plan(lat, 0, jnp.asarray([[[7, 11, 12]]], jnp.int32))
    np.testing.assert_array_equal(np.asarray(res.miss_pos)[0, :2], [11, 12])
    assert sorted(np.asarray(res.victim_slot)[0, :2].tolist()) == [0, 3]
    np.testing.assert_array_equal(np.asarray(new.slot_pos)[0, 0], [11, 7, 9, 12])
    np.testing.assert_array_equal(np.asarray(new.slot_stamp)[0, 0], [5, 4, 2, 5])
    np.testing.assert_array_equal(np.asarray(new.slot_pref)[0, 0], [True, False, True, True])
    stats = dict(zip(latent.STAT_NAMES, np.asarray(new.stats)[0].tolist()))
    assert stats["predicted"] == 3 and stats["prefetch_unused"] == 0
    assert stats["lookups"] == stats["hits"] == stats["misses"] == 0
    # the real selection reads 11 and 9, both loaded ahead (11 by this prediction, 9
    # before): 2 hits, both prefetched and used; 12 stays flagged, unread; of the
    # predicted positions one (11) was selected
    after, real = resolve(new, 0, jnp.asarray([[[11, 9]]], jnp.int32),
                          predicted=jnp.asarray([[[7, 11, 12]]], jnp.int32))
    stats = dict(zip(latent.STAT_NAMES, np.asarray(after.stats)[0].tolist()))
    assert stats["lookups"] == 2 and stats["hits"] == 2 and stats["misses"] == 0
    assert stats["prefetch_used"] == 2 and stats["predicted_correct"] == 1
    assert np.asarray(after.slot_pref)[0, 0].tolist() == [False, False, False, True]


def test_the_in_jit_path_refuses_prefetch_ahead():
    with pytest.raises(ConfigError, match="cache.prefetch_ahead.*host-driven"):
        BASE.replace(cache__offload=True, cache__fetch_path="in_jit",
                     cache__prefetch_ahead=True)


def test_health_reports_the_prediction():
    m = OffloadMetrics(2, 16)
    stats = np.zeros((2, len(latent.STAT_NAMES)), np.int64)
    stats[1, latent.STAT_NAMES.index("predicted")] = 9
    stats[1, latent.STAT_NAMES.index("predicted_correct")] = 7
    record_stats(m, stats)
    per = m.health()["per_layer"]
    assert per["rows_predicted"] == [0, 9] and per["rows_predicted_correct"] == [0, 7]
    from jlco.server.metrics import _prefetch_metrics       # /metrics, per layer
    fams = {f.name: [(s.labels["layer"], s.value) for s in f.samples]
            for f in _prefetch_metrics(m.health())}
    assert fams["jlco_prefetch_rows_predicted"] == [("0", 0), ("1", 9)]
    assert fams["jlco_prefetch_rows_predicted_correct"] == [("0", 0), ("1", 7)]


def _stepwise(cfg, model, prompts, new_tokens):
    """Run to the end one `step` at a time → (tokens, log-probs, per-step per-layer
    health deltas, final health)."""
    eng = Engine(cfg, model)
    reqs = [eng.submit(p, n) for p, n in zip(prompts, new_tokens)]
    before, deltas = eng.metrics.health()["per_layer"], []
    while eng.step():
        now = eng.metrics.health()["per_layer"]
        deltas.append({k: np.subtract(now[k], before[k]) for k in now})
        before = now
    assert all(r.status == "finished" for r in reqs)
    eng.check_no_leaks()
    return [r.tokens for r in reqs], [r.logprobs for r in reqs], deltas, eng.metrics.health()


def _check_counts(deltas, health, predicted_layers):
    for d in deltas:                    # every layer, every step
        np.testing.assert_array_equal(d["rows_needed"], d["rows_hit"]
                                      + d["rows_prefetched_used"] + d["rows_on_demand"])
        assert (d["rows_hit"] >= 0).all()
    per = health["per_layer"]
    for layer, n in enumerate(per["rows_predicted"]):
        right = per["rows_predicted_correct"][layer]
        assert (n > 0) == (layer in predicted_layers), layer
        assert 0 <= right <= min(n, per["rows_needed"][layer])


@pytest.mark.slow
def test_prefetch_ahead_is_exact_and_its_counters_add_up():
    """The engine workload (slots reused, prompts past index_topk, async scheduling):
    tokens and log-probs equal prefetch off bit for bit; layers 1 and 2 are predicted
    (layer 0 has no layer before it, the MTP layer is not a main layer); the prediction
    finds most of the rows (recall > 1/2 on this random model) and fewer rows are
    fetched on demand than without it."""
    model, prompts = make_model(), make_prompts()
    off = _stepwise(HOST, model, prompts, (9, 4, 7, 6))
    on = _stepwise(HOST.replace(cache__prefetch_ahead=True), model, prompts, (9, 4, 7, 6))
    assert on[0] == off[0] and on[1] == off[1]
    _check_counts(on[2], on[3], predicted_layers={1, 2})
    _check_counts(off[2], off[3], predicted_layers=set())
    per_on, per_off = on[3]["per_layer"], off[3]["per_layer"]
    for layer in (1, 2):
        assert per_on["rows_predicted_correct"][layer] > per_on["rows_needed"][layer] / 2
        assert per_on["rows_on_demand"][layer] < per_off["rows_on_demand"][layer]
        assert per_on["rows_prefetched_used"][layer] > per_off["rows_prefetched_used"][layer]
    assert per_on["rows_needed"] == per_off["rows_needed"]


@pytest.mark.slow
def test_depth_two_predicts_from_two_layers_back():
    """cache.prefetch_depth=2: layer 0's input predicts layer 2 (layer 1 has no layer two
    before it); tokens and log-probs equal prefetch off, the counters add up."""
    model, prompts = make_model(), make_prompts()
    off = _stepwise(HOST, model, prompts, (9, 4, 7, 6))
    on = _stepwise(HOST.replace(cache__prefetch_ahead=True, cache__prefetch_depth=2), model,
                   prompts, (9, 4, 7, 6))
    assert on[0] == off[0] and on[1] == off[1]
    _check_counts(on[2], on[3], predicted_layers={2})


@pytest.mark.slow
def test_index_share_groups_are_predicted_at_their_full_layer():
    """GLM-5 IndexShare (full, shared, full, shared): only layer 2 (a full layer after
    layer 1) is predicted; a shared layer looks nothing up itself: it reads its group's
    rows, which its full layer fetched before it, so none of its rows is on demand in
    any step (the issue's done-when, prefetch on and off); tokens equal."""
    pattern = ("full", "shared", "full", "shared")
    cfg = HOST.replace(model=dataclasses.replace(
        BASE.model, model_type="glm_moe_dsa", num_hidden_layers=4, n_group=1, topk_group=1,
        indexer_types=pattern, rope_scaling=None, num_nextn_predict_layers=0))
    model = DeepseekV32(cfg.model, rngs=nnx.Rngs(0))
    prompts = make_prompts()
    off = _stepwise(cfg, model, prompts, (9, 4, 7, 6))
    on = _stepwise(cfg.replace(cache__prefetch_ahead=True), model, prompts, (9, 4, 7, 6))
    assert on[0] == off[0] and on[1] == off[1]
    _check_counts(on[2], on[3], predicted_layers={2})
    for run in (off, on):
        for d in run[2]:                                  # every decode step
            assert d["rows_on_demand"][1] == d["rows_on_demand"][3] == 0
        per = run[3]["per_layer"]
        for full, shared in ((0, 1), (2, 3)):             # the group's rows, seen by both
            for key in ("rows_needed", "rows_hit", "rows_prefetched_unused"):
                assert per[key][shared] == per[key][full], key
            assert per["rows_prefetched_used"][shared] == (
                per["rows_prefetched_used"][full] + per["rows_on_demand"][full])
    per = on[3]["per_layer"]
    assert per["rows_prefetched_used"][2] > off[3]["per_layer"]["rows_prefetched_used"][2]


@pytest.mark.slow
@pytest.mark.parametrize("knobs", [dict(cache__prefetch_ahead=True),
                                   dict(cache__prefetch_ahead=True,
                                        cache__split_attention=True)])
def test_with_mtp_and_prefix_reuse(knobs):
    """MTP drafts (the verify step's s = 2 queries predicted together) and a prompt that
    reuses a finished one's pages (prefix cache): the tokens of the knobs off."""
    cfg = HOST.replace(engine__num_draft_tokens=1)
    model = make_model(cfg)
    first = make_prompts((70,))[0]
    prompts = [first, first + make_prompts((20,), seed=3)[0]]
    got = {}
    for name, c in (("off", cfg), ("on", cfg.replace(**knobs))):
        eng = Engine(c, model)
        a = eng.generate([prompts[0]], 6)[0]
        b = eng.generate([prompts[1]], 6)[0]
        assert b.cached_tokens > 0
        got[name] = (a.tokens, b.tokens)
    assert got["on"] == got["off"]


def test_the_workload_is_exact_with_both_knobs():
    """Cheap default-tier check: two requests, split attention and prefetch on together,
    the tokens of both off."""
    model, prompts = make_model(), make_prompts((70, 40))
    _, off = run_workload(HOST, model, prompts, (3, 3))
    _, on = run_workload(HOST.replace(cache__prefetch_ahead=True, cache__split_attention=True),
                         model, prompts, (3, 3))
    assert [t for t, _ in on] == [t for t, _ in off]
