"""The servers a client benchmark measures (`tools/bench_multiturn.py`,
`tools/bench_agentic.py`): their shared absl flags, the check that exactly one of --url
(a running server) and --config (start servers here) is given, and the run against
each target: the running server, one started here, or with --compare_prefix_cache two
started one after the other (never at once: they would share the CPU) with
`cache.prefix_cache=true` and `=false`. A started server's stderr goes to --out.
"""

from __future__ import annotations

import pathlib
from typing import Callable

from absl import flags

from jlco.ops import loadgen
from jlco.util import atomic

FLAGS = flags.FLAGS
REPO = pathlib.Path(__file__).resolve().parents[2]


def define_flags() -> None:
    flags.DEFINE_string("url", None, "a running server, http://HOST:PORT")
    flags.DEFINE_string("config", None, "start servers here with this config")
    flags.DEFINE_multi_string("override", [], "section.field=value for the started servers")
    flags.DEFINE_bool("compare_prefix_cache", False, "start two servers in turn, "
                      "cache.prefix_cache on and off, and compare them")
    flags.DEFINE_string("api_key", None, "sent as 'Authorization: Bearer KEY'")
    flags.DEFINE_float("server_timeout_s", 1800.0, "seconds a server gets to become ready")
    flags.DEFINE_float("request_timeout_s", 1800.0, "per-request HTTP timeout")
    flags.DEFINE_string("out", None, "output directory (default: out/ in the repository)")


def at_least(lows: dict[str, int]) -> None:
    """Each integer flag named in `lows` at or above its low, else a ValueError naming it."""
    for name, low in lows.items():
        if getattr(FLAGS, name) < low:
            raise ValueError(f"--{name}={getattr(FLAGS, name)}: allowed an integer >= {low}")


def check_flags(report: str) -> pathlib.Path:
    """The output directory (made; `report` must be writable in it), or a ValueError
    naming the flags in conflict."""
    if (FLAGS.url is None) == (FLAGS.config is None):
        raise ValueError("give --url (a running server) or --config (start servers here)")
    if FLAGS.url is not None and (FLAGS.compare_prefix_cache or FLAGS.override):
        raise ValueError("--url talks to a running server: --compare_prefix_cache and "
                         "--override start servers (use --config)")
    out = pathlib.Path(FLAGS.out).expanduser() if FLAGS.out else REPO / "out"
    atomic.check_writable(out / report, "--out")
    out.mkdir(parents=True, exist_ok=True)
    return out


def run_targets(measure: Callable[[str], dict], out: pathlib.Path, prog: str,
                log_name: str) -> list[dict]:
    """`measure(url)` against each target → [{label, (overrides, server_log,) **its
    report}]: labelled "prefix cache true" / "false" when comparing, else "server"."""
    if FLAGS.compare_prefix_cache:
        plan = [(f"prefix cache {v}", list(FLAGS.override) + [f"cache.prefix_cache={v}"])
                for v in ("true", "false")]
    else:
        plan = [("server", list(FLAGS.override))]
    if FLAGS.url is not None:
        return [dict(label="server", **measure(loadgen.normalize_url(FLAGS.url)))]
    reports = []
    for label, overrides in plan:
        log = out / f"{log_name}_{label.replace(' ', '_')}.log"
        args = loadgen.serve_args(config=FLAGS.config, overrides=overrides,
                                  api_key=FLAGS.api_key)
        srv = loadgen.start_serve(label, lambda *_: args, log, FLAGS.server_timeout_s,
                                  prog=prog)
        try:
            rep = measure(srv.url)
        finally:
            srv.stop()
        reports.append(dict(label=label, overrides=overrides, server_log=str(log), **rep))
    return reports
