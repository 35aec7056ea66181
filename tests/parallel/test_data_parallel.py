"""Data-parallel attention (`jlco.parallel.data`): requests pinned to data ranks, each
rank's caches and host pool split off, the engine's tokens those of one device.

The scheduler and page pools run in-process (plain Python). The engine runs in a
subprocess with 4 CPU devices (jax fixes its device count when it starts): the tiny
model on a data=2 x expert=2 mesh, offloaded, 4 slots (2 per rank), 6 requests of
different lengths (slots and pages reused mid-run, prompts longer than the hot buffer so
rows really move), greedy and sampled, half of them with penalties (each rank seats and
counts its own slots' tables), against the same engine without a mesh.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from jlco.engine.scheduler import RequestError, Scheduler
from jlco.offload.pages import HostPoolFull, PageLeakError, RankedPages

ROOT = pathlib.Path(__file__).resolve().parents[2]


# ---- pages and scheduler (in-process) ----------------------------------------------------


def test_ranked_pages_hand_out_rank_local_ids_and_keep_requests_on_their_rank():
    pages = RankedPages(2, 4, 16)
    assert pages.reserve("a", 20, rank=1) == (0, 1)        # rank 1's pages 0 and 1
    assert pages.reserve("b", 16, rank=0) == (0,)
    assert pages.reserve("a", 40) == (0, 1, 2)             # grows on its own rank
    with pytest.raises(ValueError, match="holds pages on rank 1"):
        pages.reserve("a", 48, rank=0)
    assert (pages.rank_of("a"), pages.rank_of("b")) == (1, 0)
    assert (pages.used_pages, pages.free_pages, pages.num_pages) == (4, 4, 8)
    assert pages.usage(1) == 0.75 and pages.usage(0) == 0.25
    assert pages.page_table(["b", None, "a"], 3).tolist() == [[0, -1, -1], [-1, -1, -1],
                                                              [0, 1, 2]]
    with pytest.raises(HostPoolFull):
        pages.reserve("c", 5 * 16, rank=0)                 # rank 0 holds 4 pages
    pages.check(expect_requests={"a", "b"})
    with pytest.raises(PageLeakError):
        pages.check(expect_requests={"a"})
    assert pages.release("a") == 3 and pages.release("a") == 0
    assert pages.used_pages == 1


def test_scheduler_pins_requests_to_the_least_used_rank():
    pages = RankedPages(2, 8, 16)
    sched = Scheduler(4, 128, 100, pages, ranks=2)
    big = sched.add([1] * 60, 40)      # 7 pages
    small = sched.add([1] * 10, 6)     # 1 page
    third = sched.add([1] * 10, 6)
    admitted = sched.schedule().prefills
    assert admitted == (big, small, third)
    # big → rank 0 (both empty, lowest rank), small → rank 1 (rank 0's pool 7/8 used),
    # third → rank 1 (1/8 used beats 7/8).
    assert (big.slot, small.slot, third.slot) == (0, 2, 3)
    assert [pages.rank_of(r.id) for r in (big, small, third)] == [0, 1, 1]
    assert sched.admitted_per_rank == [1, 2]
    assert [u["running"] for u in sched.rank_usage()] == [1.0, 2.0]
    # Rank 1's slots are full and rank 0 has one free page: a 2-page request waits.
    waiter = sched.add([1] * 20, 12)
    assert sched.schedule().prefills == ()
    sched.abort(big.id)
    assert sched.schedule().prefills == (waiter,) and waiter.slot == 0
    sched.check_no_leaks()


def test_scheduler_refuses_ranks_that_do_not_split_the_slots():
    with pytest.raises(ValueError, match="ranks=3"):
        Scheduler(4, 128, 100, None, ranks=3)
    with pytest.raises(ValueError, match="RankedPages of 2 ranks"):
        from jlco.offload.pages import PageAllocator
        Scheduler(4, 128, 100, PageAllocator(8, 16), ranks=2)
    sched = Scheduler(2, 64, 100, None, ranks=2)
    sched.add([1] * 8, 4)
    sched.add([1] * 8, 4)
    a, b = sched.schedule().prefills
    assert (a.slot, b.slot) == (0, 1)                   # one per rank
    with pytest.raises(RequestError, match="no free batch slot"):
        sched.add_running(8, 4)


# ---- the engine on a 4-device mesh (subprocess) -----------------------------------------

_SCRIPT = textwrap.dedent("""
    import json
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec
    from tests.support.engine_workload import BASE, make_model, make_prompts
    from jlco.engine.core import Engine
    from jlco.parallel.mesh import check_mesh, make_mesh, shard_model
    from jlco.sampling.penalties import Penalties

    RULES = Penalties(presence=0.5, frequency=0.3, repetition=1.3, min_tokens=2,
                      logit_bias=((7, 2.0), (3, 1.5)))

    LENS, NEW = (70, 5, 90, 40, 120, 33), (6, 9, 5, 7, 4, 8)
    TEMPS = (0.0, 0.8, 0.0, 1.0, 0.0, 0.7)

    def run(cfg, mesh):
        model = make_model(cfg)
        if mesh is not None:
            shard_model(model, mesh)
        with jax.set_mesh(mesh) if mesh is not None else __import__("contextlib").nullcontext():
            eng = Engine(cfg, model)
            # every other request with penalties, a bias and min_tokens (tables per rank)
            reqs = [eng.submit(p, n, temperature=t, seed=11 + i, stop_token_ids=[3],
                               penalties=RULES if i % 2 else None) for i, (p, n, t) in
                    enumerate(zip(make_prompts(LENS), NEW, TEMPS))]
            local = None
            while eng.has_work:
                eng.step()
                busy = [r for r in eng.scheduler.slots if r is not None and r.tokens]
                if mesh is not None and local is None and len(busy) == 4:
                    local = locality(eng)
            eng.check_no_leaks()
            snap = eng.metrics.snapshot()["total"]
            return dict(tokens=[r.tokens for r in reqs], logprobs=[r.logprobs for r in reqs],
                        status=[r.status for r in reqs], misses=snap["misses"],
                        lookups=snap["lookups"], local=local,
                        admitted=eng.scheduler.admitted_per_rank)

    def locality(eng):
        # Every rank's block of the layer-0 host pool holds rows only in the pages of
        # the requests pinned to that rank, and all of their written rows (read with
        # no step in flight: async scheduling queues one behind every engine step).
        eng.drain()
        lat = eng.runner.cache.latent
        host = lat.host[0]
        per_rank = host.shape[0] // 2
        page = lat.page_size
        pages = eng.scheduler.pages
        out = {"spec": str(host.sharding.spec), "rows_spec": str(lat.rows.sharding.spec),
               "ranks": []}
        for shard in host.addressable_shards:
            rank = shard.index[0].start // per_rank
            data = np.asarray(shard.data)
            written = set(np.flatnonzero(data.any(axis=1)).tolist())
            want = set()
            for r in eng.scheduler.slots:
                if r is None or pages.rank_of(r.id) != rank:
                    continue
                n = len(r.prompt) + len(r.tokens) - 1
                for pos in range(n):
                    want.add(pages.pages_of(r.id)[pos // page] * page + pos % page)
            out["ranks"].append([rank, sorted(written - want)[:5], len(want - written),
                                 len(want)])
        return out

    mesh_cfg = BASE.replace(cache__offload=True, engine__max_batch_size=4,
                            mesh__data=2, mesh__expert=2)
    check_mesh(mesh_cfg)
    split = run(mesh_cfg, make_mesh(mesh_cfg))
    one = run(BASE.replace(cache__offload=True, engine__max_batch_size=4), None)
    print(json.dumps({"split": split, "one": one}))
""")


@pytest.mark.slow   # long on 2 CPU cores: the slow tier (pyproject.toml)
def test_engine_with_data_parallel_attention_equals_one_device():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    split, one = got["split"], got["one"]
    assert split["status"] == ["finished"] * 6
    assert split["tokens"] == one["tokens"]
    for a, b in zip(split["logprobs"], one["logprobs"]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5   # f32; see test_mesh.py
    assert split["misses"] > 0 and split["misses"] == one["misses"]
    assert split["lookups"] == one["lookups"]
    assert all(n >= 2 for n in split["admitted"])            # both ranks served requests
    local = split["local"]
    assert local is not None
    assert local["spec"] == str(("data",)) or "data" in local["spec"]
    assert "data" in local["rows_spec"]
    for rank, foreign, missing, wanted in local["ranks"]:
        assert wanted > 0, rank
        assert foreign == [] and missing == 0, (rank, foreign, missing)


_PREFIX_SCRIPT = textwrap.dedent("""
    import json
    import jax
    from tests.support.engine_workload import BASE, make_model, make_prompts
    from jlco.engine.core import Engine
    from jlco.parallel.mesh import make_mesh, shard_model

    base = make_prompts((70,))[0]
    turns = [base + [i + 1] * (5 + i) for i in range(4)]

    def run(cfg, mesh):
        model = make_model(cfg)
        if mesh is not None:
            shard_model(model, mesh)
        with jax.set_mesh(mesh) if mesh is not None else __import__("contextlib").nullcontext():
            eng = Engine(cfg, model)
            eng.generate([base], 3)
            reqs = [eng.submit(p, 4) for p in turns]
            ranks = {}
            while eng.has_work:
                eng.step()
                for r in reqs:
                    if r.slot is not None:
                        ranks[r.id] = eng.scheduler.rank_of_slot(r.slot)
            eng.check_no_leaks()
            return dict(tokens=[r.tokens for r in reqs], cached=[r.cached_tokens for r in reqs],
                        ranks=sorted(set(ranks.values())))

    mesh_cfg = BASE.replace(cache__offload=True, engine__max_batch_size=4,
                            engine__prefill_chunk=32, mesh__data=2, mesh__expert=2)
    split = run(mesh_cfg, make_mesh(mesh_cfg))
    one = run(mesh_cfg.replace(mesh__data=1, mesh__expert=1, cache__prefix_cache=False), None)
    print(json.dumps({"split": split, "one": one}))
""")


@pytest.mark.slow   # long on 2 CPU cores: the slow tier (pyproject.toml)
def test_a_prefix_is_shared_across_data_ranks():
    """One prefix cache per engine process: requests on either data rank reuse a prompt
    prefilled on one of them, with the tokens of a one-device engine without reuse."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", _PREFIX_SCRIPT], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    split, one = got["split"], got["one"]
    assert split["ranks"] == [0, 1], "the four turns ran on both ranks"
    assert split["cached"] == [64] * 4 and one["cached"] == [0] * 4
    assert split["tokens"] == one["tokens"]
