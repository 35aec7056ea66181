"""`python -m jlco.diagnose`: answer the offload design's three troubleshooting
questions — throughput not up, latency jitter, memory growth — for a running server,
with numbers from its /metrics read over an interval.

    python -m jlco.diagnose --url http://HOST:PORT [--interval_s 10] [--hardware h200]
        [--probe_requests N] [--json]

Each finding names the knob to turn (cache.hot_buffer_rows, cache.prefetch_threads,
cache.fetch_chunk_rows, cache.eviction, cache.fetch_path, engine.max_batch_size, ...) and
why; the thresholds are in jlco/ops/diagnose.py's docstring. --hardware (a
jlco/planning/hardware.py profile) puts the achieved H2D rate beside that chip's host
link. With no traffic during the interval it says so; --probe_requests N sends a small
streamed load of its own during the interval (one untimed request first, so compiles
stay out of it). Exit 0 with a report (--json: the JSON); 2 with one `jlco.diagnose:
error: ...` line for bad flags or a server it cannot reach.
"""

from __future__ import annotations

import asyncio
import logging as pylog
import sys

from absl import flags, logging

from jlco.util import atomic, cli

PROG = "jlco.diagnose"
FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("url", None, "the server, http://HOST:PORT (a /v1 suffix is dropped)")
    flags.DEFINE_float("interval_s", 10.0, "seconds between the first and last /metrics read")
    flags.DEFINE_string("hardware", None, "hardware profile for the host link bandwidth "
                        "(jlco/planning/hardware.py: h20, h100, h200, b200, tpu_v5e, ...)")
    flags.DEFINE_integer("probe_requests", 0, "send this many streamed requests during the "
                         "interval (0: only watch)")
    flags.DEFINE_integer("probe_clients", 4, "probe: concurrent streams")
    flags.DEFINE_integer("probe_prompt_len", 128, "probe: prompt tokens per request")
    flags.DEFINE_integer("probe_max_tokens", 32, "probe: tokens per request")
    flags.DEFINE_integer("seed", 0, "probe prompts")
    flags.DEFINE_float("request_timeout_s", 600.0, "per-request HTTP timeout")
    flags.DEFINE_string("api_key", None, "sent as 'Authorization: Bearer KEY'")
    flags.DEFINE_bool("json", False, "print the JSON report instead of the readable one")
    flags.DEFINE_string("out", None, "also write the JSON report to this file")


def check_flags():
    """→ (url, link GB/s or None, hardware name or None, probe LoadSpec or None)."""
    from jlco.ops import loadgen
    if FLAGS.url is None:
        raise ValueError("--url is required: the server to diagnose, http://HOST:PORT")
    url = loadgen.normalize_url(FLAGS.url)
    if not FLAGS.interval_s > 0:
        raise ValueError(f"--interval_s={FLAGS.interval_s}: allowed a number > 0")
    if not FLAGS.request_timeout_s > 0:
        raise ValueError(f"--request_timeout_s={FLAGS.request_timeout_s}: allowed a number > 0")
    for name, low in (("probe_requests", 0), ("probe_clients", 1), ("probe_prompt_len", 1),
                      ("probe_max_tokens", 1), ("seed", 0)):
        if getattr(FLAGS, name) < low:
            raise ValueError(f"--{name}={getattr(FLAGS, name)}: allowed an integer >= {low}")
    link = name = None
    if FLAGS.hardware is not None:
        from jlco.planning.hardware import get_hardware
        hw = get_hardware(FLAGS.hardware)
        link, name = hw.host_link_gbps.value, hw.name
    if FLAGS.out is not None:
        atomic.check_writable(FLAGS.out, "--out")
    probe = None
    if FLAGS.probe_requests:
        probe = loadgen.LoadSpec(num_requests=FLAGS.probe_requests,
                                 num_clients=min(FLAGS.probe_clients, FLAGS.probe_requests),
                                 prompt_len=FLAGS.probe_prompt_len,
                                 max_tokens=FLAGS.probe_max_tokens, seed=FLAGS.seed)
    return url, link, name, probe


def main(argv):
    if len(argv) > 1:
        cli.fail(PROG, f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    pylog.getLogger("httpx").setLevel(pylog.WARNING)
    with cli.errors_exit(PROG, ValueError, OSError):
        url, link, hardware, probe = check_flags()
    from jlco.ops import diagnose as ops_diagnose, loadgen
    with cli.interruptible(PROG):
        try:
            obs = asyncio.run(ops_diagnose.observe(url, FLAGS.interval_s, api_key=FLAGS.api_key,
                                                   probe=probe,
                                                   timeout_s=FLAGS.request_timeout_s))
        except loadgen.LoadError as err:
            cli.fail(PROG, str(err), err.code)
    rep = dict(tool=PROG, command=" ".join(sys.argv), interval_s_asked=FLAGS.interval_s,
               **ops_diagnose.diagnose(obs, link, hardware))
    if FLAGS.out is not None:
        atomic.write_text(FLAGS.out, cli.report_json(rep) + "\n")
    print(cli.report_json(rep) if FLAGS.json else ops_diagnose.text(rep))


if __name__ == "__main__":
    define_flags()
    cli.run_main(main, flags_parser=cli.flags_parser(PROG))
