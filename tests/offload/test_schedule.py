"""The derived fetch chunk and prefetch depth (`jlco.offload.schedule`, "auto" in
`cache.fetch_chunk_rows` / `cache.prefetch_depth`): by hand on made-up link figures, the
config's range checks, explicit values overriding, and the start-up probe's figures."""

import pytest

from jlco.config import ConfigError, load_config
from jlco.engine import allocation, fetch_schedule
from jlco.offload import schedule
from jlco.planning import probe

TINY = load_config("configs/tiny.py")


def test_chunk_rows_by_hand():
    # PCIe-like: 50 GB/s, 20 us a chunk, 656-byte rows: 8 * 20e-6 * 50e9 / 656 = 12195
    # rows → the next power of two
    assert schedule.derive_chunk_rows(656, 50e9, 20e-6) == 16384
    # a slow link or a cheap chunk: small chunks, never below the floor
    assert schedule.derive_chunk_rows(1152, 1e9, 10e-6) == 128          # 69.4 → 128
    assert schedule.derive_chunk_rows(1152, 1e9, 1e-7) == schedule.MIN_CHUNK_ROWS
    assert schedule.derive_chunk_rows(64, 1e12, 1e-3) == schedule.MAX_CHUNK_ROWS
    with pytest.raises(ValueError, match="link_bytes_s=0"):
        schedule.derive_chunk_rows(656, 0, 1e-5)


def test_depth_by_hand():
    # 2048 rows x 656 B at 25 GB/s + 20 us = 73.7 us against 1 ms layers: one layer
    assert schedule.derive_depth(2048, 656, 25e9, 20e-6, 1e-3) == 1
    # the same transfer against 30 us layers: 3 layers of compute cover it
    assert schedule.derive_depth(2048, 656, 25e9, 20e-6, 30e-6) == 3
    assert schedule.derive_depth(1e6, 656, 1e9, 1e-5, 1e-6) == schedule.MAX_DEPTH
    assert schedule.derive_depth(0, 656, 25e9, 20e-6, 1e-3) == 1
    with pytest.raises(ValueError, match="rows_per_layer=-1"):
        schedule.derive_depth(-1, 656, 25e9, 20e-6, 1e-3)


def test_prefetch_depth_auto_follows_the_measured_step():
    d = schedule.PrefetchDepth("auto", 4, 656, 25e9, 20e-6)
    assert d.depth == 1                                  # before any step
    assert d.observe(4 * 30e-6, 2048) == 3 and d.depth == 3
    assert d.observe(4 * 1e-3, 2048) == 1
    fixed = schedule.PrefetchDepth(2, 4, 656, 25e9, 20e-6)
    assert fixed.observe(4 * 30e-6, 2048) == 2           # an explicit depth stays
    with pytest.raises(ValueError, match="prefetch_depth=5"):
        schedule.PrefetchDepth(5, 4, 656, 25e9, 20e-6)


def test_config_accepts_auto_or_a_range():
    assert TINY.cache.prefetch_depth == "auto"
    assert TINY.replace(cache__fetch_chunk_rows="auto").cache.fetch_chunk_rows == "auto"
    for bad in (-1, "fast", 1.5):
        with pytest.raises(ConfigError, match="cache.fetch_chunk_rows"):
            TINY.replace(cache__fetch_chunk_rows=bad)
    for bad in (0, 5, "deep"):
        with pytest.raises(ConfigError, match="cache.prefetch_depth"):
            TINY.replace(cache__prefetch_depth=bad)
    assert schedule.MAX_DEPTH == 4                       # config.py's bound names it


def test_auto_is_derived_from_the_probe_and_explicit_values_override():
    cfg = TINY.replace(cache__offload=True, cache__fetch_chunk_rows="auto")
    got = probe.host_transfer(cfg.row_bytes)
    assert got["link_gbps"] > 0 and got["overhead_us"] > 0
    assert probe.host_transfer(cfg.row_bytes) is got      # measured once per process
    want = schedule.derive_chunk_rows(cfg.row_bytes, got["link_gbps"] * 1e9,
                                      got["overhead_us"] * 1e-6)
    assert fetch_schedule.chunk_rows(cfg) == want
    assert allocation._chunk_rows(cfg) == min(want, cfg.hot_buffer_rows)
    assert fetch_schedule.chunk_rows(cfg.replace(cache__fetch_chunk_rows=48)) == 48
    assert fetch_schedule.prefetch_depth(cfg.replace(cache__prefetch_depth=3), 4).depth == 3


def test_the_probe_runs_under_a_mesh():
    """The engine asks for the transfer probe while it builds under `jax.set_mesh`: on a
    two-device mesh the one-device probe must still run (it failed with 'incompatible
    devices' before it got a thread of its own)."""
    import os
    import subprocess
    import sys
    code = ("import jax\nfrom jlco.planning import probe\n"
            "with jax.set_mesh(jax.make_mesh((2,), ('data',))):\n"
            "    print(probe.host_transfer(64)['link_gbps'] > 0)\n")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr[-2000:]
