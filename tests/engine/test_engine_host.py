"""Host-driven miss fetch (cache.fetch_path="host_driven") vs on-device and in-jit:
tokens and log-probs EXACTLY equal to offload-off (pinned_host and file storage, LRU
and FIFO, f32 and fp8 rows, requests joining and leaving on 2 slots, s_q = 2), and the
same hits/misses/bytes as the in-jit path on the same workload (same policy, same
resolution sequence). Workload as in test_engine.py."""

import os

import pytest
from tests.support.engine_workload import BASE, assert_forward_equal
from tests.support.engine_workload import run_workload as _run

from jlco.engine import host_driven as engine_host
from jlco.engine.core import Engine
from jlco.engine.allocation import device_cache_bytes
from jlco.offload import host_fetch
from jlco.planning.trace import read_trace
from jlco.util.buckets import pow2_bucket

COUNTS = ("lookups", "hits", "misses", "h2d_rows", "d2h_rows")


def test_host_driven_equals_on_device_and_in_jit(model, prompts, tmp_path):
    """pinned_host, LRU, f32 rows, transfers in chunks of 16 rows (several per layer)."""
    cfg = BASE.replace(cache__offload=True, cache__eviction="lru", cache__fetch_chunk_rows=16)
    _, base = _run(BASE, model, prompts)
    jit_eng, in_jit = _run(cfg.replace(cache__fetch_path="in_jit"), model, prompts,
                           trace_path=str(tmp_path / "jit.trc"))
    eng, got = _run(cfg.replace(cache__fetch_path="host_driven"), model, prompts,
                    trace_path=str(tmp_path / "host.trc"))
    assert eng.runner.host is not None and jit_eng.runner.host is None
    assert got == base == in_jit
    # the per-micro-batch top-k records add up to the in-jit step's
    a, b = read_trace(tmp_path / "jit.trc"), read_trace(tmp_path / "host.trc")
    assert sorted(a.keys()) == sorted(b.keys()) and len(a.keys()) > 0
    for key in a.keys():
        assert [list(x) for x in a.sets(*key)] == [list(x) for x in b.sets(*key)]
    ours, theirs = (e.metrics.snapshot()["per_layer"] for e in (eng, jit_eng))
    for k in COUNTS:
        assert ours[k] == theirs[k], k
    assert eng.runner.warmup_rows == jit_eng.runner.warmup_rows > 0
    assert sum(ours["misses"]) > 0
    layers = BASE.model.num_hidden_layers
    assert all(w > 0 for w in ours["fetch_wait_s"][:layers])
    # padded to powers of two, at most the window per chunk: never fewer rows than missed
    assert all(m >= r for m, r in zip(ours["h2d_moved_rows"], ours["h2d_rows"]))
    # the host pool is outside the cache pytree: same device bytes as the in-jit engine
    assert device_cache_bytes(cfg.replace(cache__fetch_path="host_driven"), 2) == \
        device_cache_bytes(cfg, 2)


@pytest.mark.slow
def test_file_storage_fp8_fifo(model, prompts, tmp_path, monkeypatch):
    """storage "file" (np.memmap; auto picks host_driven), FIFO, fp8 rows, one transfer
    per micro-batch, and the gather split across both prefetch threads."""
    monkeypatch.setattr(host_fetch, "MIN_ROWS_PER_THREAD", 2)
    fp8 = BASE.replace(cache__kv_format="fp8")
    _, base = _run(fp8, model, prompts)
    cfg = fp8.replace(cache__offload=True, cache__storage="file",
                      cache__storage_path=str(tmp_path), cache__eviction="fifo",
                      cache__hot_buffer_rows=48, cache__fetch_chunk_rows=0,
                      cache__prefetch_threads=2)
    eng, got = _run(cfg, model, prompts)
    assert eng.runner.host is not None and eng.runner.host.pool.storage == "file"
    assert got == base
    total = eng.metrics.snapshot()["total"]
    assert total["lookups"] == total["hits"] + total["misses"] > 0
    assert total["misses"] > 0 and total["d2h_rows"] > 0
    assert len(os.listdir(tmp_path)) == 1
    eng.runner.host.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_multi_token_forward_equal(model, prompts):
    """s_q = 2 through Engine.forward (the verification pass of speculative decoding),
    from unpinned_host memory. The hot buffer holds s_q * topk rows; no drafter is needed
    for the verification pass itself (speculative steps run the in-jit path only)."""
    cfg = BASE.replace(cache__hot_buffer_rows=2 * BASE.model.index_topk)
    off = Engine(cfg, model)
    on = Engine(cfg.replace(cache__offload=True, cache__fetch_path="host_driven",
                            cache__storage="unpinned_host", cache__eviction="fifo"), model)
    assert on.runner.host.pool.storage == "unpinned_host"
    assert_forward_equal(off, on, prompts[2:])


def test_fetch_path_choice_and_errors(tmp_path):
    cfg = BASE.replace(cache__offload=True)
    assert cfg.resolved_fetch_path() == "in_jit"
    assert cfg.replace(cache__storage="unpinned_host",
                       cache__fetch_path="host_driven").resolved_fetch_path() == "host_driven"
    file_cfg = cfg.replace(cache__storage="file", cache__storage_path=str(tmp_path))
    assert file_cfg.resolved_fetch_path() == "host_driven"
    with pytest.raises(NotImplementedError, match="fetch_path='in_jit'.*storage='file'"):
        file_cfg.replace(cache__fetch_path="in_jit").resolved_fetch_path()


def test_micro_batches_and_buckets():
    assert engine_host.micro_batches(1) == ((0, 1),)
    assert engine_host.micro_batches(2) == ((0, 1), (1, 1))
    assert engine_host.micro_batches(5) == ((0, 3), (3, 2))
    assert [pow2_bucket(n, cap=0) for n in (1, 3, 4, 5, 100)] == [1, 4, 4, 8, 128]
    assert pow2_bucket(100, cap=96) == 96 and pow2_bucket(5, cap=16) == 8
    assert pow2_bucket(3, 64, 512) == 64 and pow2_bucket(700, 64, 512) == 512
