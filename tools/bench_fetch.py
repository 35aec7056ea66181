"""Benchmark host→device scattered latent-row fetches for each miss-fetch path, and
in-place device→host row writes, on whatever device JAX sees.

  python tools/bench_fetch.py --rows=64,512,2048 --pool_rows=480000 --json_out=/tmp/f.json

On CPU "host" and "device" are the same RAM: the figures measure the mechanics
(dispatch, gather, scatter, padding), not a PCIe link; the output says so.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jlco.offload.fetch import MissFetcher
from jlco.offload.host_pool import HostLatentPool
from jlco.offload.hot_buffer import init_hot_buffer, resolve
from jlco.offload.pages import PageAllocator

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
    flags.DEFINE_string("json_out", "", "write results here as JSON")


def _median_s(fn, iters):
    fn()  # compile / warm
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def bench_fetch(pool, page_table, n, path, chunk, iters, rng):
    """Fetch n scattered rows (all misses) into an empty hot buffer, repeatedly."""
    positions = rng.choice(pool.num_rows, n, replace=False).astype(np.int32)
    hb = init_hot_buffer(1, 1, n, pool.row_bytes)
    res = resolve(hb.slot_pos[0], hb.slot_stamp[0], jnp.asarray(positions)[None, None], 0)
    fetcher = MissFetcher(pool, path, chunk)
    state = {"rows": hb.rows[0]}

    def once():
        state["rows"], stats = fetcher.fetch(state["rows"], 0, page_table, res)
        state["rows"].block_until_ready()
        state["moved"] = int(stats.moved_rows)

    t = _median_s(once, iters)
    with pool.view(0) as v:
        want = v[np.sort(positions)]
    got = np.asarray(state["rows"])[0][np.asarray(res.victim_slot[0])]
    if not (got == want).all():
        raise AssertionError(f"{path}:{chunk} fetched wrong bytes for n={n}")
    return {"kind": "fetch", "path": f"{path}:{chunk}", "rows": n, "moved_rows": state["moved"],
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


def main(argv):
    del argv
    dev = jax.devices()[0]
    rng = np.random.default_rng(FLAGS.seed)
    num_pages = -(-FLAGS.pool_rows // FLAGS.page_size)
    alloc = PageAllocator(num_pages, FLAGS.page_size)
    alloc.reserve("bench", num_pages * FLAGS.page_size)
    page_table = alloc.page_table(["bench"], num_pages)
    results = []
    with HostLatentPool(1, num_pages, FLAGS.page_size, FLAGS.row_bytes, FLAGS.storage,
                        FLAGS.storage_path) as pool:
        results.append(bench_write(pool, 1, FLAGS.iters, rng))
        for n in map(int, FLAGS.rows):
            results.append(bench_write(pool, n, FLAGS.iters, rng))
            for spec in FLAGS.paths:
                path, chunk = spec.split(":")
                results.append(bench_fetch(pool, page_table, n, path, int(chunk), FLAGS.iters, rng))
    note = ("CPU backend: host and device share RAM; these figures measure the mechanics "
            "only, not a host-device link" if dev.platform == "cpu" else "")
    report = {"device": str(dev), "platform": dev.platform, "jax": jax.__version__,
              "pool_bytes": num_pages * FLAGS.page_size * FLAGS.row_bytes,
              "row_bytes": FLAGS.row_bytes, "storage": FLAGS.storage, "note": note,
              "results": results}
    print(f"{'kind':6} {'path':16} {'rows':>6} {'moved':>6} {'median ms':>10} {'GB/s':>8}")
    for r in results:
        print(f"{r['kind']:6} {r['path']:16} {r['rows']:6d} {r['moved_rows']:6d} "
              f"{r['median_s'] * 1e3:10.3f} {r['real_GBps']:8.3f}")
    print(f"device {dev} (jax {jax.__version__}); pool {report['pool_bytes'] / 1e6:.0f} MB. {note}")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    define_flags()
    app.run(main)
