"""The prefetch scheduler's health numbers (`OffloadMetrics.health`): of the rows
attention reads, which were resident from an earlier step, which were loaded ahead of
need (the admission warm-up) and which were fetched on demand; rows loaded ahead and
never read. Counted inside the step (`jlco.offload.latent.prefetch_use`), the same on
both fetch paths."""

import jax.numpy as jnp
import numpy as np
import pytest

from jlco.engine.core import Engine
from jlco.offload.latent import prefetch_use
from tests.support.engine_workload import BASE, make_model, make_prompts


def test_prefetch_use_by_hand():
    pref = jnp.asarray([[True, True, True, False], [True, False, False, False]])
    # row 0 reads slots 0, 1 and 3, and slot 1 is refilled by a miss; row 1 reads nothing
    # and its prefetched slot 0 is refilled (evicted unread)
    slot_ids = jnp.asarray([[[0, 1, 3]], [[-1, -1, -1]]])
    victim = jnp.asarray([[1, -1], [0, -1]])
    left, used, wasted = prefetch_use(pref, slot_ids, victim)
    assert int(used) == 1 and int(wasted) == 2          # slot 0 of row 0; slots 1 and 0
    np.testing.assert_array_equal(np.asarray(left), [[False, False, True, False],
                                                     [False, False, False, False]])


def _health(fetch_path, prompts, new_tokens):
    cfg = BASE.replace(cache__offload=True, cache__fetch_path=fetch_path,
                       engine__max_batch_size=2)
    eng = Engine(cfg, make_model(cfg))
    reqs = [eng.submit(p, n) for p, n in zip(prompts, new_tokens)]
    eng.run()
    assert all(r.status == "finished" for r in reqs)
    return eng.metrics.health(), [r.tokens for r in reqs], eng.runner.warmup_rows


@pytest.mark.parametrize("fetch_path", ["in_jit", "host_driven"])
def test_the_warm_up_rows_are_counted_as_prefetched_and_used(fetch_path):
    """A 20-token prompt (index_topk 32 sees every position): the warm-up loads all 20
    rows, the one decode step reads them and its own new row, so per layer 20 rows were
    prefetched and used, 1 was resident (written by the step), none fetched on demand."""
    prompt = make_prompts((20,))[0]
    health, _, _ = _health(fetch_path, [prompt], [2])
    per = health["per_layer"]
    n = BASE.model.num_hidden_layers        # the MTP layer's cache is not read without drafts
    per = {k: v[:n] for k, v in per.items()}
    assert per["rows_needed"] == [21] * n
    assert per["rows_prefetched_used"] == [20] * n
    assert per["rows_hit"] == [1] * n and per["rows_on_demand"] == [0] * n
    assert per["rows_prefetched_unused"] == [0] * n


def test_the_counters_add_up_and_match_on_both_paths():
    """The engine workload (slots reused, prompts past index_topk): per layer rows_needed
    = rows_hit + rows_prefetched_used + rows_on_demand; loaded-ahead rows are read or
    evicted (never more than the warm-up loaded); the host-driven path counts the same
    rows and gives the same tokens."""
    prompts = make_prompts()
    got = {p: _health(p, prompts, (9, 4, 7, 6)) for p in ("in_jit", "host_driven")}
    (a, toks_a, _), (b, toks_b, _) = got["in_jit"], got["host_driven"]
    assert toks_a == toks_b
    for key in ("rows_needed", "rows_hit", "rows_prefetched_used", "rows_prefetched_unused",
                "rows_on_demand"):
        assert a["per_layer"][key] == b["per_layer"][key], key
    per = a["per_layer"]
    for layer in range(len(per["rows_needed"])):
        assert per["rows_needed"][layer] == (per["rows_hit"][layer]
                                            + per["rows_prefetched_used"][layer]
                                            + per["rows_on_demand"][layer])
        assert per["rows_hit"][layer] >= 0
    t = a["total"]
    assert t["rows_prefetched_used"] > 0 and t["rows_on_demand"] > 0
    cap = BASE.replace(cache__offload=True).hot_buffer_rows
    assert 0 < t["rows_prefetched_used"] + t["rows_prefetched_unused"] \
        <= len(prompts) * cap * len(per["rows_needed"])
