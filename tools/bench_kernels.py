"""Times the Pallas kernels against their plain-XLA references (through `jlco.pallas.dispatch`).

For sparse MLA decode and the lightning indexer, at flag-chosen shapes (defaults: the real
DeepSeek-V3.2 decode shapes), each implementation is jitted, warmed up and timed as the
median of --iters runs; the table shows achieved TFLOP/s and GB/s and, where the device is
in PEAKS, the fraction of its dense bf16 peak and HBM bandwidth. Anchor: FlashMLA reports
~410 TFLOP/s sparse decode on H800 (docs/facts.md section 2); the goal for our kernel is half.

  python tools/bench_kernels.py --small          # CPU smoke run, < 1 minute
  python tools/bench_kernels.py                  # real shapes on a GPU/TPU

Results: a table on stdout and bench_kernels.json in --out (a directory, default out/ in
the repository); --json prints the JSON on stdout instead of the table (table on stderr).
Each row has two ratios: against the machine (fraction of dense bf16 peak and of memory
bandwidth: PEAKS by device kind on accelerators, --peak_gflops / --mem_gbps on CPU) and
against the plain-XLA reference a user would otherwise run (`vs_xla` = XLA time / this
impl's time, > 1 = faster).

FLOP/byte conventions (FlashMLA's): sparse MLA = 2 * b*s_q*h*topk*(d_qk + d_nope) FLOPs and
every selected row is read once per query token; indexer = 2 * b*s_q*H*D*L FLOPs and every
key (plus its fp8 scale) is read once per step, plus the [b, s_q, L] f32 scores written.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from absl import app, flags, logging
from tqdm import tqdm

from jlco.pallas import dispatch
from jlco.pallas import indexer as ix
from jlco.pallas.fp8_rows import fp8_row_bytes, quantize_kv_rows
from jlco.planning import roofline
from jlco.util import atomic, cli

REPO = pathlib.Path(__file__).resolve().parents[1]
PROG = "bench_kernels"

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Flags are defined only when this module runs as a program, so importing it
    (tests, other tools) never collides with another CLI's flag names."""
    flags.DEFINE_bool("small", False, "tiny CPU preset (overrides the shape flags)")
    flags.DEFINE_list("kernels", ["sparse_mla", "indexer"], "which kernels to time")
    flags.DEFINE_list("impls", ["auto", "xla"], "dispatch impls to time (auto = kernel)")
    flags.DEFINE_integer("batch", 16, "requests per step (b)")
    flags.DEFINE_integer("s_q", 2, "query tokens per request per step (1 + MTP drafts)")
    flags.DEFINE_integer("heads", 128, "MLA query heads (h)")
    flags.DEFINE_integer("d_nope", 512, "MLA latent (kv_lora_rank)")
    flags.DEFINE_integer("d_rope", 64, "MLA rope dims")
    flags.DEFINE_integer("topk", 2048, "selected rows per query token")
    flags.DEFINE_integer("context", 32768, "latent rows per request in the MLA cache")
    flags.DEFINE_enum("kv_format", "fp8", ["bf16", "f32", "fp8"], "MLA latent row format")
    flags.DEFINE_integer("index_heads", 64, "indexer heads (H)")
    flags.DEFINE_integer("index_dim", 128, "indexer head dim (D)")
    flags.DEFINE_integer("index_context", 131072, "indexer keys per request (L)")
    flags.DEFINE_enum("key_format", "fp8", ["bf16", "fp8"], "indexer key format")
    flags.DEFINE_integer("block_n", None, "override the tuned indexer block_n (auto impl)")
    flags.DEFINE_integer("warmup", 2, "untimed runs after compilation")
    flags.DEFINE_integer("iters", 10, "timed runs (median reported)")
    flags.DEFINE_integer("seed", 0, "input seed")
    flags.DEFINE_string("out", None, "output directory for bench_kernels.json (default: "
                        "out/ in the repository)")
    flags.DEFINE_bool("json", False, "print the JSON on stdout (the table goes to stderr)")
    flags.DEFINE_float("mem_gbps", None, "CPU memory bandwidth, GB/s "
                       "(fractions of peak on cpu; default: measured on this machine)")
    flags.DEFINE_float("peak_gflops", None, "CPU peak GFLOP/s "
                       "(fractions of peak on cpu; default: measured on this machine)")


SMALL = dict(batch=2, s_q=2, heads=16, d_nope=128, topk=64, context=256, index_heads=8,
             index_dim=64, index_context=1024, iters=3, warmup=1)

# device_kind -> (dense bf16 TFLOP/s, HBM GB/s), vendor data sheets (SXM parts).
PEAKS = {
    "NVIDIA H100 80GB HBM3": (989.0, 3350.0),
    "NVIDIA H800": (989.0, 3350.0),
    "NVIDIA H200": (989.0, 4800.0),
    "NVIDIA H20": (148.0, 4000.0),
    "NVIDIA A100-SXM4-80GB": (312.0, 2039.0),
    "TPU v4": (275.0, 1200.0),
    "TPU v5 lite": (197.0, 819.0),
    "TPU v5": (459.0, 2765.0),
    "TPU v6 lite": (918.0, 1640.0),
}


def _cfg():
    names = list(SMALL) + ["d_rope", "kv_format", "key_format", "block_n", "seed"]
    cfg = {n: getattr(FLAGS, n) for n in names}
    if FLAGS.small:
        cfg.update(SMALL)
    return cfg


def _mla_case(cfg, key):
    """Inputs for sparse MLA decode plus its FLOP and byte counts."""
    b, s_q, h, topk = cfg["batch"], cfg["s_q"], cfg["heads"], cfg["topk"]
    d_nope, d_rope, ctx, fmt = cfg["d_nope"], cfg["d_rope"], cfg["context"], cfg["kv_format"]
    d_qk = d_nope + d_rope
    kq, kr, ki = jax.random.split(key, 3)
    q = jax.random.normal(kq, (b, s_q, h, d_qk), jnp.bfloat16)
    rows = jax.random.normal(kr, (b * ctx, d_qk), jnp.bfloat16)
    kv = quantize_kv_rows(rows, d_rope=d_rope) if fmt == "fp8" else \
        rows.astype(jnp.float32 if fmt == "f32" else jnp.bfloat16)
    pick = jax.vmap(lambda k: jax.random.choice(k, ctx, (topk,), replace=False))
    local = pick(jax.random.split(ki, b * s_q)).reshape(b, s_q, topk)
    idx = (local + (jnp.arange(b) * ctx)[:, None, None]).astype(jnp.int32)
    row_bytes = fp8_row_bytes(d_nope, d_rope) if fmt == "fp8" else d_qk * kv.dtype.itemsize
    flops = 2 * b * s_q * h * topk * (d_qk + d_nope)
    nbytes = b * s_q * (topk * (row_bytes + 4) + h * (d_qk + d_nope) * 2 + h * 4)
    fns = {impl: jax.jit(lambda q, kv, idx, impl=impl: dispatch.sparse_mla(
        q, kv, idx, d_qk ** -0.5, kv_format=fmt, d_rope=d_rope, impl=impl))
        for impl in FLAGS.impls}
    return fns, (q, kv, idx), flops, nbytes


def _indexer_case(cfg, key):
    """Inputs for the lightning indexer (all requests at full context) plus FLOPs/bytes."""
    b, s_q, hh, d = cfg["batch"], cfg["s_q"], cfg["index_heads"], cfg["index_dim"]
    length, topk, fmt = cfg["index_context"], cfg["topk"], cfg["key_format"]
    kq, kw, kk, ks = jax.random.split(key, 4)
    q = jax.random.normal(kq, (b, s_q, hh, d), jnp.bfloat16)
    w = jax.random.normal(kw, (b, s_q, hh), jnp.float32) * (hh * d) ** -0.5
    keys = jax.random.normal(kk, (b, length, d), jnp.bfloat16)
    scale = None
    if fmt == "fp8":
        keys = jax.lax.bitcast_convert_type(keys.astype(jnp.float8_e4m3fn), jnp.uint8)
        scale = 2.0 ** jax.random.randint(ks, (b, length), -4, 4).astype(jnp.float32)
    lengths = jnp.full((b,), length, jnp.int32)
    flops = 2 * b * s_q * hh * d * length
    nbytes = b * length * (d * keys.dtype.itemsize + (4 if fmt == "fp8" else 0)) \
        + b * s_q * length * 4 * 2

    def make(impl):
        if impl == "auto" and cfg["block_n"]:
            return jax.jit(lambda *a: ix.indexer_topk(*a[:4], topk, k_scale=a[4],
                                                      key_format=fmt, block_n=cfg["block_n"]))
        return jax.jit(lambda *a: dispatch.indexer_topk(*a[:4], topk, k_scale=a[4],
                                                        key_format=fmt, impl=impl))
    return {impl: make(impl) for impl in FLAGS.impls}, (q, w, keys, lengths, scale), \
        flops, nbytes


def _time(fn, args, warmup, iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), compile_s


def _row(kernel, impl, sec, compile_s, flops, nbytes, peak):
    tflops, gbs = flops / sec / 1e12, nbytes / sec / 1e9
    return dict(kernel=kernel, impl=impl, median_ms=sec * 1e3, compile_s=compile_s,
                tflops=tflops, gbs=gbs,
                frac_peak_flops=tflops / peak[0] if peak else None,
                frac_peak_bw=gbs / peak[1] if peak else None)


def _vs_xla(rows):
    """Each row's speed against the plain-XLA reference of the same kernel."""
    ref = {r["kernel"]: r["median_ms"] for r in rows if r["impl"] == "xla"}
    for r in rows:
        r["vs_xla"] = ref[r["kernel"]] / r["median_ms"] if r["kernel"] in ref else None


def _table(rows):
    def pct(x):
        return "   n/a" if x is None else f"{100 * x:5.1f}%"
    lines = [f"{'kernel':<11}{'impl':<10}{'ms':>10}{'TFLOP/s':>10}{'GB/s':>10}"
             f"{'%peakF':>8}{'%peakBW':>8}{'vs xla':>8}{'compile s':>10}"]
    for r in rows:
        vs = "     n/a" if r["vs_xla"] is None else f"{r['vs_xla']:7.2f}x"
        lines.append(f"{r['kernel']:<11}{r['impl']:<10}{r['median_ms']:>10.3f}"
                     f"{r['tflops']:>10.3f}{r['gbs']:>10.1f}{pct(r['frac_peak_flops']):>8}"
                     f"{pct(r['frac_peak_bw']):>8}{vs}{r['compile_s']:>10.1f}")
    return "\n".join(lines)


def _peak(dev):
    """(TFLOP/s, GB/s) the fractions divide by, and where they come from."""
    if dev.platform == "cpu":
        m = roofline.cpu_machine(FLAGS.mem_gbps, FLAGS.peak_gflops)
        return (m.peak_flops / 1e12, m.mem_bw / 1e9), m.source
    if dev.device_kind in PEAKS:
        return PEAKS[dev.device_kind], "PEAKS (vendor data sheet)"
    key = roofline.profile_for_device_kind(dev.device_kind)
    if key is not None:
        m = roofline.hardware_machine(key)
        return (m.peak_flops / 1e12, m.mem_bw / 1e9), f"jlco.planning.hardware {key!r}"
    return None, f"unknown device kind {dev.device_kind!r}"


def _out_dir() -> pathlib.Path:
    out = pathlib.Path(FLAGS.out).expanduser() if FLAGS.out else REPO / "out"
    if out.suffix == ".json":
        raise ValueError(f"--out={FLAGS.out}: takes a directory (the JSON is written to "
                         "DIR/bench_kernels.json)")
    atomic.check_writable(out / "bench_kernels.json", "--out")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _check_flags(builders):
    bad = [k for k in FLAGS.kernels if k not in builders]
    if bad:
        raise ValueError(f"--kernels: unknown {bad}; allowed {sorted(builders)}")
    bad = [i for i in FLAGS.impls if i not in dispatch.IMPLS]
    if bad:
        raise ValueError(f"--impls: unknown {bad}; allowed {list(dispatch.IMPLS)}")
    if "pallas" in FLAGS.impls and jax.default_backend() == "cpu":
        raise ValueError("--impls=pallas needs a GPU or TPU (this backend is cpu): use "
                         "interpret (Pallas interpret mode, slow) or xla")
    for name in ("batch", "s_q", "heads", "d_nope", "d_rope", "topk", "context",
                 "index_heads", "index_dim", "index_context", "iters"):
        if getattr(FLAGS, name) < 1:
            raise ValueError(f"--{name}={getattr(FLAGS, name)}: allowed an integer >= 1")
    if FLAGS.warmup < 0:
        raise ValueError(f"--warmup={FLAGS.warmup}: allowed an integer >= 0")
    for name in ("mem_gbps", "peak_gflops"):
        v = getattr(FLAGS, name)
        if v is not None and not v > 0:
            raise ValueError(f"--{name}={v}: allowed a positive number (or none: measured "
                             "on this machine)")
    return _out_dir()


def main(argv):
    if len(argv) > 1:
        cli.fail(PROG, f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    builders = {"sparse_mla": _mla_case, "indexer": _indexer_case}
    with cli.errors_exit(PROG, ValueError, OSError):
        out = _check_flags(builders)
    cfg = _cfg()
    dev = jax.devices()[0]
    peak, peak_source = _peak(dev)
    key = jax.random.PRNGKey(cfg["seed"])
    jobs = [(k, i) for k in FLAGS.kernels for i in FLAGS.impls]
    rows, cases = [], {}
    for kernel, impl in tqdm(jobs, desc="bench", file=sys.stderr,
                             disable=not sys.stderr.isatty()):
        if kernel not in cases:
            cases[kernel] = builders[kernel](cfg, key)
        fns, args, flops, nbytes = cases[kernel]
        sec, compile_s = _time(fns[impl], args, cfg["warmup"], cfg["iters"])
        rows.append(_row(kernel, impl, sec, compile_s, flops, nbytes, peak))
    _vs_xla(rows)
    report = dict(device=dev.device_kind, platform=dev.platform, jax=jax.__version__,
                  peak=peak, peak_source=peak_source, config=cfg, results=rows)
    path = out / "bench_kernels.json"
    summary = (f"device: {dev.device_kind} ({dev.platform}); peak TFLOP/s, GB/s: {peak} "
               f"({peak_source})\nshapes: {json.dumps(cfg)}\n{_table(rows)}\nJSON {path}")
    cli.write_report(path, report, summary, FLAGS.json)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.flags_parser(PROG))
