"""`python -m jlco.validate`: the offload acceptance run — correctness, benefit and
stability of a server with the latent cache offloaded against one without.

    python -m jlco.validate --url http://HOST:PORT --baseline_url http://HOST2:PORT2 \\
        [--topk N]
    python -m jlco.validate --config configs/tiny.py [--override section.field=value ...]

--url is the offload server, --baseline_url the same deployment with the cache on
device. With --config (and optionally --checkpoint / --override) both are started here in
turn (`python -m jlco.serve ... --port 0 --nooffload`, then `--offload`; stopped with
SIGTERM), each first at the config's batch for the correctness check, then (with
--batch_from_budget, the default) restarted at the largest batch its banner's device
budget allows for the load, so both are compared at one device budget. What each part
checks: jlco/ops/validate.py.

index_topk (for the 'topk' lengths): --topk, else the served model's (from --config /
--checkpoint), else /v1/models' `index_topk` when the server exposes it.

Writes validate.json, validate.png and the started servers' stderr into --out, prints
the table (--json: JSON on stdout, the table on stderr). Exit 0 when everything holds,
1 on a token mismatch, an invariant failure or failed requests (one `jlco.validate:
error: ...` line naming them), 2 on bad flags.
"""

from __future__ import annotations

import logging as pylog
import pathlib
import sys
import time

from absl import flags, logging

from jlco.util import atomic, cli

PROG = "jlco.validate"
FLAGS = flags.FLAGS
_ROOT = pathlib.Path(__file__).resolve().parent.parent


def define_flags() -> None:
    flags.DEFINE_string("url", None, "the offload server, http://HOST:PORT (a /v1 suffix is "
                        "dropped); with --baseline_url, instead of --config")
    flags.DEFINE_string("baseline_url", None, "the same deployment with offload off")
    flags.DEFINE_string("config", None, "start both servers here with this config")
    flags.DEFINE_string("checkpoint", None, "checkpoint for the started servers (none: the "
                        "random-weight model)")
    flags.DEFINE_multi_string("override", [], "section.field=value for the started servers; "
                              "repeatable")
    flags.DEFINE_float("device_budget_gb", None, "device budget the started servers plan for")
    flags.DEFINE_bool("batch_from_budget", True, "started servers: run the load at the largest "
                      "batch each one's device budget allows (the correctness check runs at "
                      "the config's batch on both)")
    flags.DEFINE_float("server_timeout_s", 900.0, "seconds a server gets to become ready")
    flags.DEFINE_integer("topk", None, "the model's index_topk (default: the config's or "
                         "checkpoint's model, else /v1/models)")
    flags.DEFINE_list("check_lengths", ["8", "topk", "4topk", "limit"], "prompt lengths of the "
                      "correctness check: N tokens, 'topk', 'Ntopk' (N x index_topk), 'limit' "
                      "(context - --check_max_tokens)")
    flags.DEFINE_integer("check_max_tokens", 16, "greedy tokens per correctness prompt")
    flags.DEFINE_integer("check_limit_cap", 0, "cap on the 'limit' prompt's length (0: none)")
    flags.DEFINE_integer("num_clients", 8, "benefit: concurrent streaming clients")
    flags.DEFINE_integer("num_requests", 32, "benefit: requests")
    flags.DEFINE_integer("prompt_len", 200, "benefit: prompt tokens per request")
    flags.DEFINE_integer("max_tokens", 32, "benefit: tokens per request")
    flags.DEFINE_float("request_rate", float("inf"), "benefit: requests/s, Poisson arrivals "
                       "(inf: all at once)")
    flags.DEFINE_bool("warmup", True, "benefit: untimed requests of the same shapes first")
    flags.DEFINE_integer("seed", 0, "prompts and arrivals")
    flags.DEFINE_float("scrape_interval_s", 1.0, "stability: seconds between /metrics scrapes")
    flags.DEFINE_float("min_throughput_ratio", 0.0, "fail when offload on / baseline output "
                       "tokens/s is below this (0: reported, not checked)")
    flags.DEFINE_float("request_timeout_s", 600.0, "per-request HTTP timeout")
    flags.DEFINE_string("api_key", None, "sent as 'Authorization: Bearer KEY' (and given to "
                        "started servers)")
    flags.DEFINE_string("out", None, "output directory (default: out/validate in the "
                        "repository)")
    flags.DEFINE_bool("json", False, "print the JSON report on stdout (the table on stderr)")


def _positive(*names: str, low: float = 1) -> None:
    for name in names:
        v = getattr(FLAGS, name)
        if v is not None and not v >= low:
            raise ValueError(f"--{name}={v}: allowed a number >= {low:g}")


def check_flags():
    """Every flag checked before a server starts → (ValidateSpec, sides, out dir)."""
    from jlco.ops import loadgen, validate as ops_validate
    _positive("num_clients", "num_requests", "prompt_len", "max_tokens", "check_max_tokens",
              "topk")
    _positive("check_limit_cap", "seed", "min_throughput_ratio", low=0)
    for name in ("request_rate", "scrape_interval_s", "server_timeout_s", "request_timeout_s"):
        if not getattr(FLAGS, name) > 0:
            raise ValueError(f"--{name}={getattr(FLAGS, name)}: allowed a number > 0")
    if not FLAGS.check_lengths:
        raise ValueError("--check_lengths is empty: allowed e.g. 8,topk,4topk,limit")
    ops_validate.check_length_names(FLAGS.check_lengths)
    starts = [n for n in ("config", "checkpoint", "device_budget_gb") if FLAGS[n].value
              is not None] + (["override"] if FLAGS.override else [])
    if FLAGS.url is not None or FLAGS.baseline_url is not None:
        if FLAGS.url is None or FLAGS.baseline_url is None:
            raise ValueError("--url (offload on) and --baseline_url (offload off) go together")
        if starts:
            raise ValueError(f"--url talks to running servers, --{starts[0]} starts them: "
                             "give one or the other")
        urls = [loadgen.normalize_url(FLAGS.url), loadgen.normalize_url(FLAGS.baseline_url,
                                                                         "--baseline_url")]
        if urls[0] == urls[1]:
            raise ValueError("--url and --baseline_url are the same server")
        sides = {ops_validate.OFFLOAD: ops_validate.Side(ops_validate.OFFLOAD, "offload on",
                                                         url=urls[0]),
                 ops_validate.BASELINE: ops_validate.Side(ops_validate.BASELINE, "baseline",
                                                          url=urls[1])}
        topk = FLAGS.topk
    elif FLAGS.config is None and FLAGS.checkpoint is None:
        raise ValueError("give --url and --baseline_url (running servers) or --config (start "
                         "them here)")
    else:
        topk = FLAGS.topk or served_topk()
        sides = {k: ops_validate.Side(k, label, args_for=_args_for(on))
                 for k, label, on in ((ops_validate.OFFLOAD, "offload on", True),
                                      (ops_validate.BASELINE, "baseline, offload off", False))}
    out = pathlib.Path(FLAGS.out).expanduser() if FLAGS.out else _ROOT / "out" / "validate"
    if out.suffix == ".json":
        raise ValueError(f"--out={FLAGS.out}: takes a directory (the JSON and PNG go into it)")
    atomic.check_writable(out / "validate.json", "--out")
    out.mkdir(parents=True, exist_ok=True)
    spec = ops_validate.ValidateSpec(
        load=loadgen.LoadSpec(num_requests=FLAGS.num_requests, num_clients=FLAGS.num_clients,
                              prompt_len=FLAGS.prompt_len, max_tokens=FLAGS.max_tokens,
                              request_rate=FLAGS.request_rate, seed=FLAGS.seed,
                              warmup=FLAGS.warmup),
        check_lengths=tuple(FLAGS.check_lengths), check_max_tokens=FLAGS.check_max_tokens,
        check_limit_cap=FLAGS.check_limit_cap, topk=topk,
        scrape_every_s=FLAGS.scrape_interval_s, server_timeout_s=FLAGS.server_timeout_s,
        request_timeout_s=FLAGS.request_timeout_s, api_key=FLAGS.api_key,
        min_throughput_ratio=FLAGS.min_throughput_ratio,
        batch_from_budget=FLAGS.batch_from_budget)
    return spec, sides, out


def served_topk() -> int:
    """index_topk of the model the started servers will serve (a config with a model too
    big for random weights serves tiny's shape; a checkpoint its own)."""
    from jlco.config import apply_overrides, load_config
    from jlco.launch.load import choose_model
    from jlco.ops.loadgen import resolve_config
    path = resolve_config(FLAGS.config) if FLAGS.config else _ROOT / "configs" / "128k.py"
    if not path.is_file():
        raise ValueError(f"--config={FLAGS.config}: no such file")
    cfg = apply_overrides(load_config(path), FLAGS.override)
    return choose_model(FLAGS.checkpoint, cfg, None, 0).model.index_topk


def _args_for(offload: bool):
    from jlco.ops import loadgen

    def args(batch=None, budget_gb=None):
        return loadgen.serve_args(config=FLAGS.config, checkpoint=FLAGS.checkpoint,
                                  overrides=FLAGS.override, offload=offload, batch=batch,
                                  budget_gb=budget_gb or FLAGS.device_budget_gb,
                                  api_key=FLAGS.api_key)
    return args


def main(argv):
    if len(argv) > 1:
        cli.fail(PROG, f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    pylog.getLogger("httpx").setLevel(pylog.WARNING)
    with cli.errors_exit(PROG, ValueError, OSError):
        spec, sides, out = check_flags()
    from jlco.ops import loadgen, validate as ops_validate
    t0 = time.perf_counter()
    with cli.interruptible(PROG):
        try:
            rep = ops_validate.validate(sides, spec, out)
        except loadgen.LoadError as err:
            cli.fail(PROG, str(err), err.code)
    report = dict(tool=PROG, command=" ".join(sys.argv), machine=loadgen.machine(),
                  flags={k: FLAGS[k].value for k in (
                      "url", "baseline_url", "config", "checkpoint", "override",
                      "device_budget_gb", "batch_from_budget", "topk", "check_lengths",
                      "check_max_tokens", "check_limit_cap", "num_clients", "num_requests",
                      "prompt_len", "max_tokens", "request_rate", "warmup", "seed",
                      "scrape_interval_s", "min_throughput_ratio")},
                  **rep, wall_s=time.perf_counter() - t0)
    json_path, png_path = out / "validate.json", out / "validate.png"
    ops_validate.plot(report, png_path)
    cli.write_report(json_path, report, ops_validate.table(report) +
                     f"\n{report['machine']['summary']}; JSON {json_path}; plot {png_path}",
                     FLAGS.json)
    for w in report["warnings"]:
        cli.warn(PROG, w)
    if not report["ok"]:
        cli.fail(PROG, "; ".join(report["failures"]), cli.FAILURE_EXIT)


if __name__ == "__main__":
    define_flags()
    cli.run_main(main, flags_parser=cli.flags_parser(PROG))
