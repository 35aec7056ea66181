"""What this CPU can do, measured: the read bandwidth at a given working-set size (so a
model that fits in the last-level cache is held to the cache's rate, not DRAM's), the f32
matmul rate, both with every core XLA uses, and the cache sizes the kernel reports.
The rooflines of the CPU benchmarks divide by these (`roofline.cpu_machine`): `cpu_limits`
measures once per machine (the fastest of several runs; not kept when other work loads
the cores) and keeps the two figures in a small JSON file under
`$XDG_CACHE_HOME/jlco/probe` (a directory of this user's, mode 0700; a file another user
owns, or that others may write, is measured again, not trusted)."""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np


def _median_s(fn, *args, repeats: int, best: bool = False) -> float:
    """Median seconds of a call (the fastest with `best`: the machine's limit, which
    other work running at the same time only ever slows)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.min(times) if best else np.median(times))


def read_gbps(working_set_bytes: int, repeats: int = 20, best: bool = False) -> float:
    """GB/s of a jitted sum over `working_set_bytes` of f32 (each byte read once a call;
    the call is repeated, so a working set that fits in a cache is read from it)."""
    n = max(working_set_bytes // 4, 1 << 16)
    x = jnp.asarray(np.random.default_rng(0).random(n, np.float32))
    return 4 * n / _median_s(jax.jit(jnp.sum), x, repeats=repeats, best=best) / 1e9


def matmul_gflops(n: int = 2048, repeats: int = 5, best: bool = False) -> float:
    """GFLOP/s of one jitted [n, n] x [n, n] float32 matmul."""
    a = jnp.asarray(np.random.default_rng(1).random((n, n), np.float32))
    return 2 * n ** 3 / _median_s(jax.jit(jnp.matmul), a, a, repeats=repeats,
                                  best=best) / 1e9


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


PROBE_WORKING_SET = 128 << 20   # bytes: a decode step's weights on the models a CPU runs
BUSY_LOAD = 0.5                 # a 1-minute load average per core above this: not cached


def _machine_key() -> str:
    """What the figures depend on: the CPU (model and flags), its core count, jax."""
    cpu = ""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features")):
                cpu += line
    except OSError:
        cpu = platform.processor()
    text = f"{platform.machine()}|{cpu}|{os.cpu_count()}|{jax.__version__}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_path() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
    return pathlib.Path(base) / "jlco" / "probe" / f"cpu-{_machine_key()}.json"


def _trusted(path: pathlib.Path) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    own = not hasattr(os, "getuid") or st.st_uid == os.getuid()
    return own and not st.st_mode & 0o022


def cpu_limits() -> dict:
    """{"mem_gbps", "peak_gflops", "working_set_mb", "measured", "path"}: this machine's
    read bandwidth at PROBE_WORKING_SET and f32 matmul rate, measured on first use (a few
    seconds) and read back from `cache_path()` afterwards."""
    path = cache_path()
    if _trusted(path) and _trusted(path.parent):
        try:
            got = json.loads(path.read_text())
            if got["mem_gbps"] > 0 and got["peak_gflops"] > 0:
                return dict(got, path=str(path))
        except (OSError, ValueError, KeyError, TypeError):
            pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    got = dict(mem_gbps=read_gbps(PROBE_WORKING_SET, 30, best=True),
               peak_gflops=matmul_gflops(repeats=8, best=True),
               working_set_mb=PROBE_WORKING_SET / 1e6,
               measured=time.strftime("%Y-%m-%d %H:%M:%S %Z"), load=round(load, 2))
    if load > BUSY_LOAD * (os.cpu_count() or 1):
        # other work shared the cores: these figures are for this process only
        return dict(got, path=f"not cached: load average {load:.1f} while measuring")
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if _trusted(path.parent):
            from jlco.util import atomic
            atomic.write_text(path, json.dumps(got))
    except OSError:
        pass       # an unwritable cache: measured again next time
    return dict(got, path=str(path))


TRANSFER_BYTES = 32 << 20   # the large probe transfer: long enough to time the link rate


@functools.partial(jax.jit, donate_argnums=0)
def _scatter_rows(rows, dest, data):
    return rows.at[dest].set(data, mode="drop")


@functools.lru_cache(maxsize=None)
def host_transfer(row_bytes: int, repeats: int = 8) -> dict:
    """One fetch chunk of the host-driven path, timed as it runs there: `jax.device_put`
    of a numpy [n, row_bytes] uint8 buffer and its row ids to the first device, then a
    donated jitted scatter of the rows into a device buffer. The fastest of `repeats`
    chunks of 64 rows and of TRANSFER_BYTES, fitted as t = overhead + bytes / link →
    {"link_gbps", "overhead_us", "device"}, once per process. What
    `cache.fetch_chunk_rows="auto"` and `cache.prefetch_depth="auto"` derive from
    (`jlco.offload.schedule`); on XLA:CPU the "link" is a host memory copy."""
    if not isinstance(row_bytes, int) or row_bytes <= 0:
        raise ValueError(f"row_bytes={row_bytes!r} is invalid: allowed a positive integer")
    # A thread of its own: the engine asks while building under `jax.set_mesh` (a
    # thread-local context), and a one-device probe is not a computation of that mesh.
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(_host_transfer, row_bytes, repeats).result()


def _host_transfer(row_bytes: int, repeats: int) -> dict:
    device = jax.devices()[0]
    small, big = 64, max(128, TRANSFER_BYTES // row_bytes)
    with jax.ensure_compile_time_eval():
        rows = jax.device_put(np.zeros((big, row_bytes), np.uint8), device)

    def best_s(n: int) -> float:
        nonlocal rows
        buf, dest = np.ones((n, row_bytes), np.uint8), np.arange(n, dtype=np.int32)
        times = []
        for i in range(repeats + 1):           # the first call compiles: not timed
            t = time.perf_counter()
            rows = _scatter_rows(rows, *jax.device_put((dest, buf), device))
            jax.block_until_ready(rows)
            if i:
                times.append(time.perf_counter() - t)
        return min(times)

    with jax.ensure_compile_time_eval():   # also when first asked while tracing
        t_small, t_big = best_s(small), best_s(big)
    link = (big - small) * row_bytes / max(t_big - t_small, 1e-9)
    overhead = max(t_small - small * row_bytes / link, 1e-7)
    return dict(link_gbps=link / 1e9, overhead_us=overhead * 1e6,
                device=str(getattr(device, "device_kind", device.platform)))
