"""What a user waits for and how much memory it takes when `jlco.serve` starts on a fresh
machine: start-up to `ready:`, the first token of one long prompt, and the server's peak
RSS (`VmHWM`) at each point, against the config's memory promise.

The server runs as a user starts it (`python -m jlco.serve --config CONFIG --port 0`),
with an empty compilation cache (a fresh directory in `JLCO_COMPILATION_CACHE_DIR`, so
every program is compiled, as on a new machine) unless --cache_dir names one to reuse
(`--cache_dir DIR` twice: cold, then warm). The memory of its process is sampled every
--sample_s from /proc (VmRSS, VmHWM), so the JSON holds the whole timeline and the plot
shows where the peak is set: loading, warm-up compiles, the long prefill or decoding.
Once ready, one completion of --prompt_tokens random token ids (greedy, --max_tokens)
is sent; its time to first token is read from the stream.

  python tools/bench_cold_start.py                      # configs/128k.py, 131,072 tokens
  python tools/bench_cold_start.py --prompt_tokens 8192 --config configs/32k.py

Outputs: --json_out and --png_out (default out/bench_cold_start.{json,png}); the table
on stdout; progress on stderr. Exit 1 when the peak is above --limit_gib.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile
import threading
import time

from absl import app, flags

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jlco.ops import loadgen  # noqa: E402
from jlco.util import atomic, cli  # noqa: E402

PROG = "bench_cold_start"
FLAGS = flags.FLAGS
GIB = 2 ** 30


def define_flags() -> None:
    flags.DEFINE_string("config", "configs/128k.py", "config file")
    flags.DEFINE_integer("prompt_tokens", 131072, "the long prompt's length", lower_bound=1)
    flags.DEFINE_integer("max_tokens", 8, "tokens generated for it", lower_bound=1)
    flags.DEFINE_string("cache_dir", None, "compilation cache directory (default: a fresh "
                        "empty one, removed after; a named one is kept, so a second run "
                        "measures the warm start)")
    flags.DEFINE_list("override", [], "extra --override section.field=value for the server")
    flags.DEFINE_float("limit_gib", 6.0, "the memory promise: exit 1 above it", lower_bound=0)
    flags.DEFINE_float("sample_s", 0.5, "memory sampling period", lower_bound=0.05)
    flags.DEFINE_float("ready_timeout_s", 3600, "give up on start-up after this", lower_bound=1)
    flags.DEFINE_float("request_timeout_s", 7200, "give up on the prompt after this",
                       lower_bound=1)
    flags.DEFINE_integer("seed", 0, "prompt token ids", lower_bound=0)
    flags.DEFINE_string("json_out", None, "JSON report (default out/bench_cold_start.json)")
    flags.DEFINE_string("png_out", None, "plot (default out/bench_cold_start.png)")


def _status_kib(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0])
    return out


class Sampler:
    """VmRSS / VmHWM of one process every `period` seconds, with labelled marks."""

    def __init__(self, pid: int, period: float):
        self.pid, self.period, self.t0 = pid, period, time.monotonic()
        self.samples: list[tuple[float, float, float]] = []   # (s, rss GiB, hwm GiB)
        self.marks: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.take()

    def take(self) -> dict[str, float]:
        try:
            kib = _status_kib(self.pid)
        except (OSError, ValueError):
            return {}
        row = (time.monotonic() - self.t0, kib["VmRSS"] * 1024 / GIB, kib["VmHWM"] * 1024 / GIB)
        self.samples.append(row)
        return {"s": row[0], "rss_gib": row[1], "hwm_gib": row[2]}

    def mark(self, label: str) -> dict[str, float]:
        self.marks.append((time.monotonic() - self.t0, label))
        return self.take()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _say(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


def _long_request(url: str) -> dict:
    """One streamed greedy completion of random token ids: TTFT and the whole time."""
    import numpy as np
    import requests
    ids = np.random.default_rng(FLAGS.seed).integers(0, 256, FLAGS.prompt_tokens).tolist()
    body = {"prompt": ids, "max_tokens": FLAGS.max_tokens, "temperature": 0,
            "stream": True, "return_token_ids": True}
    t0 = time.monotonic()
    ttft, tokens = None, []
    with requests.post(url + "/v1/completions", json=body, stream=True,
                       timeout=FLAGS.request_timeout_s) as r:
        if r.status_code != 200:
            raise RuntimeError(f"the long prompt got HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            got = choice.get("token_ids") or []
            if got and ttft is None:
                ttft = time.monotonic() - t0
            tokens += got
    return {"ttft_s": ttft, "total_s": time.monotonic() - t0, "tokens": tokens}


def measure(cache_dir: str) -> dict:
    os.environ["JLCO_COMPILATION_CACHE_DIR"] = cache_dir
    cold = not any(pathlib.Path(cache_dir).iterdir())
    args = ["--config", FLAGS.config] + [a for o in FLAGS.override for a in ("--override", o)]
    log = pathlib.Path(tempfile.mkstemp(prefix="jlco_cold_start_", suffix=".log")[1])
    t0 = time.monotonic()
    server = loadgen.ServeProcess("server", args, log)
    sampler = Sampler(server.proc.pid, FLAGS.sample_s)
    try:
        _say(f"started the server ({'empty' if cold else 'existing'} compilation cache "
             f"{cache_dir}); log {log}")
        server.wait_ready(FLAGS.ready_timeout_s)
        ready = dict(sampler.mark("ready"), wall_s=time.monotonic() - t0)
        _say(f"ready after {ready['wall_s']:.0f} s, VmHWM {ready['hwm_gib']:.2f} GiB; "
             f"sending {FLAGS.prompt_tokens} tokens")
        req = _long_request(server.url)
        done = sampler.mark("answered")
        _say(f"answered: first token {req['ttft_s']:.1f} s, VmHWM {done['hwm_gib']:.2f} GiB")
    finally:
        sampler.stop()
        server.stop()
    return dict(cold_cache=cold, ready=ready, answered=done, request=req,
                samples=sampler.samples, marks=sampler.marks, log=str(log),
                server_lines=[ln for ln in server.lines if ln.startswith(("memory:", "warm"))])


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = report["samples"]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot([r[0] for r in s], [r[1] for r in s], label="VmRSS")
    ax.plot([r[0] for r in s], [r[2] for r in s], "--", label="VmHWM (peak so far)")
    ax.axhline(FLAGS.limit_gib, color="r", lw=1, label=f"promise {FLAGS.limit_gib:g} GiB")
    for t, label in report["marks"]:
        ax.axvline(t, color="k", lw=0.8, ls=":")
        ax.text(t, ax.get_ylim()[1] * 0.97, f" {label}", fontsize=8, va="top")
    ax.set(xlabel="seconds since start", ylabel="GiB",
           title=f"jlco.serve {report['config']}: {'cold' if report['cold_cache'] else 'warm'}"
                 f" compilation cache, one {report['prompt_tokens']}-token prompt")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic.temp_sibling(path, ".png") as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)


def table(r: dict) -> str:
    rows = [("phase", "wall s", "VmHWM GiB", "VmRSS GiB"),
            ("ready", f"{r['ready']['wall_s']:.0f}", f"{r['ready']['hwm_gib']:.2f}",
             f"{r['ready']['rss_gib']:.2f}"),
            (f"{r['prompt_tokens']}-token prompt answered",
             f"TTFT {r['request']['ttft_s']:.0f}", f"{r['answered']['hwm_gib']:.2f}",
             f"{r['answered']['rss_gib']:.2f}")]
    w = [max(len(x[i]) for x in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(row)) for row in rows]
    return "\n".join(lines + [f"peak {r['peak_gib']:.2f} GiB against the {r['limit_gib']:g} "
                              f"GiB promise: {'within' if r['within'] else 'ABOVE'}"])


def main(argv):
    if len(argv) > 1:
        cli.fail(PROG, f"unexpected arguments: {argv[1:]}")
    json_out = pathlib.Path(FLAGS.json_out or REPO / "out" / "bench_cold_start.json")
    png_out = pathlib.Path(FLAGS.png_out or REPO / "out" / "bench_cold_start.png")
    with cli.errors_exit(PROG, ValueError, OSError):
        for path, flag in ((json_out, "--json_out"), (png_out, "--png_out")):
            atomic.check_writable(path, flag)
        if not (REPO / FLAGS.config).exists() and not pathlib.Path(FLAGS.config).exists():
            raise ValueError(f"--config={FLAGS.config}: no such file")
    with cli.errors_exit(PROG, RuntimeError, loadgen.LoadError, OSError):
        if FLAGS.cache_dir:
            pathlib.Path(FLAGS.cache_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
            result = measure(FLAGS.cache_dir)
        else:
            with tempfile.TemporaryDirectory(prefix="jlco_cold_cache_") as d:
                result = measure(d)
    peak = max(result["ready"]["hwm_gib"], result["answered"]["hwm_gib"])
    report = dict(config=FLAGS.config, prompt_tokens=FLAGS.prompt_tokens,
                  override=FLAGS.override, command=" ".join(sys.argv), peak_gib=peak,
                  limit_gib=FLAGS.limit_gib, within=peak < FLAGS.limit_gib, **result)
    json_out.parent.mkdir(parents=True, exist_ok=True)
    plot(report, png_out)
    cli.write_report(json_out, report, table(report) + f"\nJSON {json_out}; plot {png_out}",
                     False)
    if not report["within"]:
        cli.fail(PROG, f"peak {peak:.2f} GiB is above --limit_gib={FLAGS.limit_gib:g}",
                 cli.FAILURE_EXIT)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.flags_parser(PROG))
