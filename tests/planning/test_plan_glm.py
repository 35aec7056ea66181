"""The memory plan of GLM-5 (configs/glm5.py) and its IndexShare form
(configs/glm5_index_share.py: 21 of 78 layers full): a layer that shares its top-k holds
no indexer keys and no indexer weights (and, offloaded, no slot table of its own), so
per-request device bytes drop by exactly those, and the engine's real allocation drops
by the same bytes."""

import dataclasses

from jlco.config import load_config
from jlco.engine import allocation
from jlco.planning import memory
from jlco.planning.params import weight_bytes

FULL = load_config("configs/glm5.py")
SHARE = load_config("configs/glm5_index_share.py")


def test_glm5_shapes_and_pattern():
    m = SHARE.model
    assert (m.model_type, m.num_hidden_layers, m.indexer_layers) == ("glm_moe_dsa", 78, 21)
    assert [i for i in range(78) if not m.shares_topk(i)][:4] == [0, 1, 5, 9]
    assert FULL.model.indexer_layers == 78 and FULL.indexer_key_bytes == 132   # fp8 keys


def test_per_request_bytes_drop_by_the_shared_layers_keys():
    ctx = FULL.engine.max_context_len
    for offload in (True, False):
        a = memory.per_request_bytes(FULL, ctx, offload)
        b = memory.per_request_bytes(SHARE, ctx, offload)
        assert a["indexer"] - b["indexer"] == (78 - 21) * ctx * 132
        # offloaded, the shared layers keep no slot tables either (int32 position + stamp
        # and a prefetched flag per hot row: their full layer's table serves the group)
        rows = FULL.hot_buffer_rows
        assert a["tables"] - b["tables"] == ((78 - 21) * 9 * rows if offload else 0)
        assert {k: v for k, v in a.items() if k not in ("indexer", "tables")} == \
            {k: v for k, v in b.items() if k not in ("indexer", "tables")}
    hbm = 141e9
    assert memory.max_batch(SHARE, hbm, ep=32) > memory.max_batch(FULL, hbm, ep=32)


def test_weights_drop_by_the_shared_layers_indexers():
    a, b = weight_bytes(FULL.model, 32), weight_bytes(SHARE.model, 32)
    assert a.indexer * 21 == b.indexer * 78
    assert a.total - b.total == a.indexer - b.indexer
    assert a.params_total > b.params_total and a.params_rank > b.params_rank


def test_engine_allocation_drops_what_the_planner_drops():
    """Per batch slot, the engine's device cache (abstract shapes) for a tiny GLM with two
    shared layers is smaller than the all-full one's by the planner's difference: their
    indexer keys and, offloaded, their slot tables."""
    tiny = load_config("configs/tiny.py")
    m = dataclasses.replace(tiny.model, model_type="glm_moe_dsa", num_hidden_layers=4,
                            indexer_types=("full", "shared", "shared", "full"))
    share = tiny.replace(model=m, cache__indexer_key_format="fp8")
    full = share.replace(model__indexer_types=None)
    for offload in (False, True):
        s, f = (c.replace(cache__offload=offload) for c in (share, full))
        slot = {n: allocation.device_cache_bytes(c, 2) - allocation.device_cache_bytes(c, 1)
                for n, c in (("share", s), ("full", f))}
        ctx = s.engine.max_context_len
        pf, ps = (memory.per_request_bytes(c, ctx, offload) for c in (f, s))
        planned = {k: pf[k] - ps[k] for k in ("indexer", "tables")}
        assert planned["indexer"] == 2 * ctx * (m.index_head_dim + 4)
        # offloaded, a shared layer also keeps no slot table of its own (its full layer's)
        assert planned["tables"] == (2 * 9 * s.hot_buffer_rows if offload else 0)
        assert slot["full"] - slot["share"] == planned["indexer"] + planned["tables"]
