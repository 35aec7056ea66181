"""What this CPU can do, measured: the read bandwidth at a given working-set size (so a
model that fits in the last-level cache is held to the cache's rate, not DRAM's), the f32
matmul rate, both with every core XLA uses, and the cache sizes the kernel reports.
The rooflines of the CPU benchmarks divide by these (`roofline.cpu_machine`)."""

from __future__ import annotations

import glob
import os
import time

import jax
import jax.numpy as jnp
import numpy as np


def _median_s(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def read_gbps(working_set_bytes: int, repeats: int = 20) -> float:
    """GB/s of a jitted sum over `working_set_bytes` of f32 (each byte read once a call;
    the call is repeated, so a working set that fits in a cache is read from it)."""
    n = max(working_set_bytes // 4, 1 << 16)
    x = jnp.asarray(np.random.default_rng(0).random(n, np.float32))
    return 4 * n / _median_s(jax.jit(jnp.sum), x, repeats=repeats) / 1e9


def matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of one jitted [n, n] x [n, n] float32 matmul."""
    a = jnp.asarray(np.random.default_rng(1).random((n, n), np.float32))
    return 2 * n ** 3 / _median_s(jax.jit(jnp.matmul), a, a, repeats=repeats) / 1e9


def cache_sizes() -> dict[str, str]:
    """Cache sizes of cpu0 as /sys reports them ({'L1d': '48K', 'L2': '2048K', ...})."""
    out = {}
    for d in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
        try:
            level = open(os.path.join(d, "level")).read().strip()
            kind = open(os.path.join(d, "type")).read().strip()
            size = open(os.path.join(d, "size")).read().strip()
        except OSError:
            continue
        suffix = {"Data": "d", "Instruction": "i"}.get(kind, "")
        out[f"L{level}{suffix}"] = size
    return out


def measure(working_set_bytes: int) -> dict:
    """The figures a CPU roofline needs, measured now."""
    return dict(mem_gbps=read_gbps(working_set_bytes), peak_gflops=matmul_gflops(),
                working_set_mb=working_set_bytes / 1e6, dram_gbps=read_gbps(1 << 31, 5),
                cpus=os.cpu_count(), caches=cache_sizes())
