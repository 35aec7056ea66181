"""Benchmark host→device scattered latent-row fetches on each of the engine's miss-fetch
paths, and in-place device→host row writes, on whatever device JAX sees.

  python tools/bench_fetch.py --rows=64,512,2048 --pool_rows=480000

Each fetch runs the engine's own code for one layer of one request whose empty hot buffer
of --rows slots misses every selected row: `in_jit:N` is
`jlco.offload.latent.latent_for_attention` jitted over an OffloadLatent built as the
engine builds it (fetch chunks of N rows, 0 = one padded gather), donated so the hot
buffer is written in place; `host_driven:N` is the host-driven path's sequence, a jitted
`resolve` and `jlco.offload.host_fetch.miss_list`, then `HostFetcher.fetch` (transfer
chunks of at most N rows, 0 = one). Both times include the resolution, as both paths
run it in the engine. storage "file" has no in-jit path (the engine refuses that pair),
so its in_jit entries are skipped and the note says so.

Results: a table on stdout and bench_fetch.json in --out (a directory, default out/ in
the repository); --json prints the JSON on stdout instead (table on stderr). Each fetch
row has two ratios: `frac_link` = its GB/s over the host link's (accelerators: the
`jlco.planning.hardware` profile of the device kind; CPU: --mem_gbps, the RAM bandwidth)
and `vs_first_path` = the first --paths entry's time over this path's (> 1 = faster).

On CPU "host" and "device" are the same RAM: the figures measure the mechanics
(dispatch, gather, scatter, padding), not a PCIe link; the output says so.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from jlco.config import CacheConfig
from jlco.offload.host_fetch import HostFetcher, miss_list
from jlco.offload.host_pool import HostLatentPool
from jlco.offload.hot_buffer import resolve
from jlco.offload.latent import (
    STAT_MOVED,
    STAT_NAMES,
    OffloadLatent,
    latent_for_attention,
    lookup_bound,
)
from jlco.offload.pages import PageAllocator
from jlco.planning import roofline
from jlco.util import atomic, cli

REPO = pathlib.Path(__file__).resolve().parents[1]
PROG = "bench_fetch"
FLAGS = flags.FLAGS


def define_flags() -> None:
    """Flags are defined only when this module runs as a program, so importing it
    (tests, other tools) never collides with another CLI's flag names."""
    flags.DEFINE_integer("row_bytes", 656, "bytes per latent row (656 = FlashMLA fp8 layout)")
    flags.DEFINE_list("rows", ["64", "512", "2048"], "missed rows per fetch")
    flags.DEFINE_integer("pool_rows", 480_000, "rows in the host pool (480k x 656 B = 315 MB)")
    flags.DEFINE_integer("page_size", 64, "tokens per host page")
    flags.DEFINE_enum("storage", "pinned_host", ["pinned_host", "unpinned_host", "file"], "host storage")
    flags.DEFINE_string("storage_path", "/tmp", "directory for storage=file")
    flags.DEFINE_list("paths", ["in_jit:0", "in_jit:256", "host_driven:0"],
                      "fetch paths as path:chunk_rows (chunk 0 = one padded gather)")
    flags.DEFINE_integer("iters", 10, "timed repetitions (median reported)")
    flags.DEFINE_integer("seed", 0, "row-id sampling seed")
    flags.DEFINE_string("out", None, "output directory for bench_fetch.json (default: out/ "
                        "in the repository)")
    flags.DEFINE_bool("json", False, "print the JSON on stdout (the table goes to stderr)")
    flags.DEFINE_float("mem_gbps", None, "CPU memory bandwidth, GB/s (the "
                       "'link' on cpu; default: measured on this machine)")


def _median_s(fn, iters):
    fn()  # compile / warm
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def _latent(pool, page_table, n, chunk) -> OffloadLatent:
    """One layer of one request with an empty hot buffer of n slots, built as
    `jlco.engine.allocation.allocate_cache` builds it but without its host arrays (the
    in-jit step takes them apart; the host-driven path reads the pool from the host).
    Committed to the device as the step's outputs are, so a repetition compiles nothing."""
    return jax.device_put(OffloadLatent(
        rows=jnp.zeros((1, 1, n, pool.row_bytes), jnp.uint8),
        slot_pos=jnp.full((1, 1, n), -1, jnp.int32),
        slot_stamp=jnp.full((1, 1, n), -1, jnp.int32),
        slot_pref=jnp.zeros((1, 1, n), bool), host=(),
        page_table=jnp.asarray(page_table, jnp.int32), step=jnp.int32(0),
        stats=jnp.zeros((1, len(STAT_NAMES)), jnp.int32), policy="lru",
        page_size=pool.page_size, chunk_rows=chunk), pool.device)


def _in_jit_step(lat, host, positions):
    """`latent_for_attention` on layer 0 of `lat` (its host pool passed apart) → (lat
    with its slot table and counters emptied again, so the next repetition misses every
    row too; slot ids [1, 1, n]; rows moved; the host pool). The pool comes back as an
    output in its own memory kind (`_jit_in_jit_step`), as in the engine's step: XLA:GPU
    refuses a jit whose host-memory parameter reaches an output declared as device
    memory (E1200, jax 0.11.2)."""
    out, _, ids = latent_for_attention(dataclasses.replace(lat, host=host), 0, positions)
    return (dataclasses.replace(out, host=(), slot_pos=jnp.full_like(out.slot_pos, -1),
                                slot_stamp=jnp.full_like(out.slot_stamp, -1),
                                stats=jnp.zeros_like(out.stats)), ids,
            out.stats[0, STAT_MOVED], out.host)


def _jit_in_jit_step(pool):
    """`_in_jit_step` jitted for `pool`: the device state and the pool donated, outputs
    pinned (the pool to its memory kind, the rest to the device)."""
    dev = jax.sharding.SingleDeviceSharding(pool.device)
    return jax.jit(_in_jit_step, donate_argnums=(0, 1),
                   out_shardings=(dev, dev, dev, (pool.sharding,)))


@jax.jit
def _select(lat, positions):
    """The host-driven selection after the indexer (as `jlco.engine.host_driven`'s):
    `resolve` against layer 0's table, which stays empty → (slot ids, miss list)."""
    res = resolve(lat.slot_pos[0], lat.slot_stamp[0], positions, lat.step, lat.policy,
                  num_positions=lookup_bound(lat, None))
    return (res.slot_ids, *miss_list(res, lat.page_table, lat.page_size, lat.rows.shape[2]))


def _in_jit_run(pool, page_table, positions, n, chunk):
    """→ (one repetition, its result: hot-buffer rows [n, R], slot ids [n], rows moved)."""
    step = _jit_in_jit_step(pool)
    state = {"lat": _latent(pool, page_table, n, chunk), "host": (pool.array(0),)}

    def once():
        state["lat"], state["ids"], state["moved"], state["host"] = step(
            state["lat"], state["host"], positions)
        state["lat"].rows.block_until_ready()

    def result():
        pool.set_array(0, state["host"][0])
        return state["lat"].rows[0, 0], state["ids"][0, 0], state["moved"]

    return once, result


def _host_run(pool, page_table, positions, n, chunk, fetcher):
    """`_in_jit_run` for the host-driven path."""
    lat = _latent(pool, page_table, n, chunk)
    state = {"rows": lat.rows}

    def once():
        state["ids"], miss_ids, dest = _select(lat, positions)
        state["rows"], state["moved"] = fetcher.fetch(state["rows"], 0, miss_ids, dest)
        state["rows"].block_until_ready()

    return once, lambda: (state["rows"][0, 0], state["ids"][0, 0], state["moved"])


def bench_fetch(pool, page_table, n, path, chunk, iters, rng):
    """Fetch n scattered rows (all misses) into an empty hot buffer, repeatedly."""
    positions = rng.choice(pool.num_rows, n, replace=False).astype(np.int32)
    pos = jnp.asarray(positions)[None, None]
    fetcher = None
    if path == "in_jit":
        once, result = _in_jit_run(pool, page_table, pos, n, chunk)
    else:
        fetcher = HostFetcher(pool, chunk, CacheConfig().prefetch_threads)
        once, result = _host_run(pool, page_table, pos, n, chunk, fetcher)
    try:
        t = _median_s(once, iters)
    finally:
        if fetcher is not None:
            fetcher.close()
    rows, slot_ids, moved = result()
    page = pool.page_size
    with pool.view(0) as v:
        want = v[page_table[0, positions // page] * page + positions % page]
    got = np.asarray(rows)[np.asarray(slot_ids)]
    if not (got == want).all():
        raise AssertionError(f"{path}:{chunk} fetched wrong bytes for n={n}")
    return {"kind": "fetch", "path": f"{path}:{chunk}", "rows": n, "moved_rows": int(moved),
            "median_s": t, "real_GBps": n * pool.row_bytes / t / 1e9}


def bench_write(pool, n, iters, rng):
    """Device→host write of n new rows into the pool (donated in-place scatter)."""
    ids = jnp.asarray(rng.choice(pool.num_rows, n, replace=False).astype(np.int32))
    data = jnp.asarray(rng.integers(0, 256, (n, pool.row_bytes), dtype=np.uint8))

    def once():
        pool.write(0, ids, data)
        pool.flush()

    t = _median_s(once, iters)
    return {"kind": "write", "path": pool.storage, "rows": n, "moved_rows": n, "median_s": t,
            "real_GBps": n * pool.row_bytes / t / 1e9}


def _link_gbps(dev) -> tuple[float | None, str]:
    """The host link's GB/s per direction the fetch rates are compared to."""
    if dev.platform == "cpu":
        m = roofline.cpu_machine(FLAGS.mem_gbps, 1.0)   # the peak is not used here
        return m.mem_bw / 1e9, ("--mem_gbps" if FLAGS.mem_gbps else m.source) + \
            " (CPU: host and device are the same RAM)"
    key = roofline.profile_for_device_kind(dev.device_kind)
    if key is None:
        return None, f"unknown device kind {dev.device_kind!r}"
    return roofline.hardware_machine(key).host_bw / 1e9, f"jlco.planning.hardware {key!r}"


def _check_flags() -> pathlib.Path:
    for name in ("row_bytes", "pool_rows", "page_size", "iters"):
        if getattr(FLAGS, name) < 1:
            raise ValueError(f"--{name}={getattr(FLAGS, name)}: allowed an integer >= 1")
    try:
        rows = [int(n) for n in FLAGS.rows]
    except ValueError:
        rows = [0]
    if not rows or min(rows) < 1 or max(rows) > FLAGS.pool_rows:
        raise ValueError(f"--rows={','.join(FLAGS.rows)}: allowed integers in 1..--pool_rows "
                         f"({FLAGS.pool_rows})")
    for spec in FLAGS.paths:
        path, sep, chunk = spec.partition(":")
        if path not in ("in_jit", "host_driven") or not sep or not chunk.isdigit():
            raise ValueError(f"--paths: {spec!r} is invalid: allowed in_jit:N or "
                             "host_driven:N (N = chunk rows, 0 = one padded gather)")
    if FLAGS.mem_gbps is not None and not FLAGS.mem_gbps > 0:
        raise ValueError(f"--mem_gbps={FLAGS.mem_gbps}: allowed a positive number (or none: "
                         "measured on this machine)")
    out = pathlib.Path(FLAGS.out).expanduser() if FLAGS.out else REPO / "out"
    if out.suffix == ".json":
        raise ValueError(f"--out={FLAGS.out}: takes a directory (the JSON is written to "
                         "DIR/bench_fetch.json)")
    atomic.check_writable(out / "bench_fetch.json", "--out")
    out.mkdir(parents=True, exist_ok=True)
    return out


def main(argv):
    if len(argv) > 1:
        cli.fail(PROG, f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    with cli.errors_exit(PROG, ValueError, OSError):
        out = _check_flags()
    dev = jax.devices()[0]
    rng = np.random.default_rng(FLAGS.seed)
    num_pages = -(-FLAGS.pool_rows // FLAGS.page_size)
    alloc = PageAllocator(num_pages, FLAGS.page_size)
    alloc.reserve("bench", num_pages * FLAGS.page_size)
    page_table = alloc.page_table(["bench"], num_pages)
    results, skipped = [], []
    with HostLatentPool(1, num_pages, FLAGS.page_size, FLAGS.row_bytes, FLAGS.storage,
                        FLAGS.storage_path) as pool:
        results.append(bench_write(pool, 1, FLAGS.iters, rng))
        for n in map(int, FLAGS.rows):
            results.append(bench_write(pool, n, FLAGS.iters, rng))
            for spec in FLAGS.paths:
                path, chunk = spec.split(":")
                if path == "in_jit" and FLAGS.storage == "file":
                    skipped.append(spec)
                    continue
                results.append(bench_fetch(pool, page_table, n, path, int(chunk), FLAGS.iters, rng))
    link, link_source = _link_gbps(dev)
    first = FLAGS.paths[0]
    for r in results:
        r["frac_link"] = r["real_GBps"] / link if link else None
        ref = next((x for x in results if x["kind"] == r["kind"] == "fetch"
                    and x["rows"] == r["rows"] and x["path"] == first), None)
        r["vs_first_path"] = ref["median_s"] / r["median_s"] if ref else None
    notes = (["CPU backend: host and device share RAM; these figures measure the mechanics "
              "only, not a host-device link"] if dev.platform == "cpu" else [])
    if skipped:
        notes.append(f"skipped {', '.join(dict.fromkeys(skipped))}: storage 'file' has no "
                     "in-jit fetch path")
    note = "; ".join(notes)
    report = {"device": str(dev), "device_kind": dev.device_kind, "platform": dev.platform,
              "jax": jax.__version__,
              "pool_bytes": num_pages * FLAGS.page_size * FLAGS.row_bytes,
              "row_bytes": FLAGS.row_bytes, "storage": FLAGS.storage, "note": note,
              "link_gbps": link, "link_source": link_source, "results": results}
    lines = [f"{'kind':6} {'path':16} {'rows':>6} {'moved':>6} {'median ms':>10} {'GB/s':>8} "
             f"{'%link':>7} {'vs ' + first:>16}"]
    for r in results:
        frac = "    n/a" if r["frac_link"] is None else f"{100 * r['frac_link']:6.2f}%"
        vs = "n/a" if r["vs_first_path"] is None else f"{r['vs_first_path']:.2f}x"
        lines.append(f"{r['kind']:6} {r['path']:16} {r['rows']:6d} {r['moved_rows']:6d} "
                     f"{r['median_s'] * 1e3:10.3f} {r['real_GBps']:8.3f} {frac} {vs:>16}")
    path = out / "bench_fetch.json"
    lines.append(f"device {dev} (jax {jax.__version__}); pool {report['pool_bytes'] / 1e6:.0f} "
                 f"MB; link {link} GB/s ({link_source}). {note}\nJSON {path}")
    cli.write_report(path, report, "\n".join(lines), FLAGS.json)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.flags_parser(PROG))
