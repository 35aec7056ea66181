"""`python -m jlco.serve`: an OpenAI-compatible HTTP server over the engine.

    python -m jlco.serve --config configs/128k.py [--checkpoint DIR] [--port N]
        [--offload/--nooffload] [--override section.field=value ...] [--api_key KEY]

Without --checkpoint it serves a small RANDOM-WEIGHT model with the config's context
and cache settings and says so (the real 671B shapes need a checkpoint and a mesh); its
tokenizer is byte-level, so text in gives text out, and its chat template is plain
("role: content" lines, then "assistant: "; `jlco.server.text.PLAIN_CHAT_TEMPLATE`).
The port opens at once (GET /health answers 503 while the model loads and compiles)
and a readiness line follows the
banner, which prints the memory plan: device bytes (weights, cache), the host pool, and
the largest batch with and without offload at the same device budget. SIGTERM or SIGINT
drains: the port stays open but new requests get 503, running ones finish within
--grace_s, the rest are aborted, then the port closes, a `drained:` line says which
happened, the host pool (its file too) is freed, exit 0; a second signal stops at once.
The banner also names the decode step that runs (`decode step: MTP speculative, 1
draft(s); fetch in_jit; mesh ...; async (...)`): drafts, the fetch path, the mesh and
async scheduling compose in any combination; steps run synchronously only with
engine.async_scheduling=false or a drafter that proposes on the host (the banner says
which), and a batch holding a structured-output request waits for the step in flight.
Bad flags or config values: one `jlco.serve: error: ...` line, exit 2. Routes and fields:
jlco/server/app.py.

Several processes (hosts): every process runs the same command with
--coordinator_address HOST:PORT --num_processes N --process_id I (or the JAX_*
environment variables; --num_processes auto for SLURM, Open MPI, Cloud TPU, Kubernetes),
and --mesh counts every process's devices. Process 0 serves HTTP (every route but PD
import/export, which answer 501) and the others run its engine steps in lockstep
(`jlco.server.lockstep`); they bind no port and need no tokenizer beyond the
checkpoint's. A process that dies or stops beating for --peer_timeout_s ends the job:
process 0's open requests get an error, /health turns 503, and every process exits 1
with a line naming the process that failed. SIGTERM on process 0 drains and stops them
all (exit 0); a follower's first SIGTERM only says it waits for process 0's stop.
"""

from __future__ import annotations

import logging as pylog
import os
import pathlib
import signal
import sys
import threading

from absl import app, flags, logging

from jlco.parallel import distributed
from jlco.server import lockstep
from jlco.util import cli, compile_cache

FLAGS = flags.FLAGS
PROG = "jlco.serve"
_ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = _ROOT / "configs" / "128k.py"
_SHAPES_PER_LINE = 8    # warm-up progress: a line per this many compiled shapes


def define_flags() -> None:
    flags.DEFINE_string("config", str(DEFAULT_CONFIG), "config file (configs/*.py)")
    flags.DEFINE_string("checkpoint", None, "HF or jlco Orbax checkpoint directory (none: a "
                        "small random-weight model)")
    flags.DEFINE_string("host", None, "address to bind (default serve.host: 127.0.0.1)")
    flags.DEFINE_integer("port", None, "port (default serve.port; 0 = any free port)",
                         lower_bound=0, upper_bound=65535)
    flags.DEFINE_bool("offload", None, "latent cache in host memory (default: the config's)")
    flags.DEFINE_multi_string("override", [], "section.field=value (a Python literal, or a "
                              "string), e.g. engine.max_batch_size=8; repeatable")
    flags.DEFINE_string("api_key", None, "require 'Authorization: Bearer KEY' on /v1 routes")
    flags.DEFINE_enum("tool_call_parser", None, ["deepseek_v32", "glm_moe_dsa"],
                      "the tool-call syntax chat's tool_choice auto parses (default: the "
                      "checkpoint's model_type)")
    flags.DEFINE_enum("reasoning_parser", None, ["deepseek_v32", "glm_moe_dsa"],
                      "the thinking delimiters split into reasoning_content (default: the "
                      "checkpoint's model_type)")
    flags.DEFINE_string("served_model_name", None, "model id in the API (default: the "
                        "checkpoint directory's name, or the config's name)")
    flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"], "compute dtype")
    flags.DEFINE_integer("seed", 0, "random model's weights", lower_bound=0)
    flags.DEFINE_bool("verify_checkpoint", True, "check Orbax leaves' sha256 sums")
    flags.DEFINE_float("grace_s", 30.0, "on SIGTERM: seconds running requests get to finish",
                       lower_bound=0.0)
    flags.DEFINE_float("device_budget_gb", None, "device memory the banner plans batches "
                       "for (default: the accelerator's limit; on CPU the bytes the "
                       "no-offload engine needs at engine.max_batch_size)", lower_bound=0.0)
    flags.DEFINE_bool("warmup", True, "compile every prefill and decode shape (and serve one "
                      "small request) before ready; off: requests compile as they come")
    flags.DEFINE_string("mesh", None, "device mesh, e.g. expert=4 (fields left out are 1; "
                        "default: the config's mesh section); data > 1: data-parallel "
                        "attention, the batch slots split over the data ranks")
    distributed.define_flags()
    flags.DEFINE_float("peer_timeout_s", lockstep.DEFAULT_PEER_TIMEOUT_S, "several "
                       "processes: a process whose heartbeat is this old (seconds) has "
                       "failed, and the job ends", lower_bound=1.0)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- building


def prepare():
    """Everything that can fail on bad input, before any weight: (cfg, choice, name)."""
    from jlco.config import apply_overrides, load_config
    from jlco.launch import load
    base = apply_overrides(load_config(FLAGS.config), FLAGS.override)
    if FLAGS.mesh is not None:
        from jlco.planning.mesh import mesh_overrides
        base = base.replace(**mesh_overrides(FLAGS.mesh))
    if FLAGS.offload is not None:
        base = base.replace(cache__offload=FLAGS.offload)
    if FLAGS.host is not None:
        base = base.replace(serve__host=FLAGS.host)
    if FLAGS.port is not None:
        base = base.replace(serve__port=FLAGS.port)
    choice = load.choose_model(FLAGS.checkpoint, base, FLAGS.dtype, FLAGS.seed)
    name = (f"jlco-random-{base.name}" if FLAGS.checkpoint is None
            else pathlib.Path(FLAGS.checkpoint).resolve().name)
    mpe = choice.model.max_position_embeddings
    if base.engine.max_context_len > mpe:
        raise ValueError(f"engine.max_context_len={base.engine.max_context_len} is invalid: "
                         f"allowed <= the model's max_position_embeddings ({mpe})")
    v4 = {"cache__prefix_cache": False} if choice.model.model_type == "deepseek_v4" else {}
    cfg = base.replace(model=choice.model, name=base.name, **v4)   # validates the joint config
    return cfg, choice, FLAGS.served_model_name or name


def memory_plan(cfg, weight_bytes: int) -> list[str]:
    """The banner's memory lines: device split, host pool, largest batch with and without
    offload at one device budget."""
    if cfg.is_v4:
        return v4_memory_plan(cfg, weight_bytes)
    import jax

    from jlco.engine.allocation import (batch_for_budget, device_cache_bytes,
                                        prefill_workspace_bytes, prefix_cache_bytes,
                                        prefix_pages)
    from jlco.model.kv_cache import cache_layers
    batch = cfg.engine.max_batch_size
    dev_cache = device_cache_bytes(cfg, batch)
    off_cfg = cfg.replace(cache__offload=False)
    on_cfg = cfg.replace(cache__offload=True)
    budget, why = None, ""
    if FLAGS.device_budget_gb is not None:
        budget, why = FLAGS.device_budget_gb * 1e9, "--device_budget_gb"
    else:
        stats = jax.devices()[0].memory_stats() or {}
        if stats.get("bytes_limit"):
            budget, why = float(stats["bytes_limit"]), f"{jax.devices()[0].device_kind} limit"
        else:
            budget = weight_bytes + device_cache_bytes(off_cfg, batch)
            why = f"what offload off needs at batch {batch} (no accelerator limit on CPU)"
    def gb(b: float) -> str:
        return f"{b / 1e9:.3f} GB"
    lines = [f"memory: device {gb(weight_bytes + dev_cache)} = weights {gb(weight_bytes)} + "
             f"cache {gb(dev_cache)} (batch {batch}, context {cfg.engine.max_context_len}, "
             f"offload {'on' if cfg.cache.offload else 'off'})"]
    if cfg.cache.offload:
        page, ctx = cfg.cache.page_size, cfg.engine.max_context_len
        pool = batch * -(-ctx // page) * page * cfg.row_bytes * cache_layers(cfg)
        lines.append(f"memory: host pool {gb(pool)} in {cfg.cache.storage} "
                     f"({cfg.hot_buffer_rows} hot rows per request and layer on device)")
    work = prefill_workspace_bytes(cfg)
    lines.append(f"memory: prefill workspace {gb(work)} (a long prefill and a short one beside "
                 f"it: two [1, {cfg.engine.max_context_len}] caches + one "
                 f"{cfg.engine.prefill_chunk}-token chunk's working set, whatever the prompts' "
                 "lengths)")
    if cfg.cache.prefix_cache:
        lines.append(f"memory: prefix cache up to {gb(prefix_cache_bytes(cfg))} in host memory "
                     f"({prefix_pages(cfg) * cfg.cache.page_size} positions, least recently "
                     "used first out; cache.prefix_cache_tokens)")
    b_off = batch_for_budget(off_cfg, budget, other_bytes=weight_bytes)
    b_on = batch_for_budget(on_cfg, budget, other_bytes=weight_bytes)
    lines.append(f"memory: device budget {gb(budget)} ({why}): largest batch {b_off} with "
                 f"offload off, {b_on} with offload on (x{b_on / max(b_off, 1):.1f})")
    return lines


def v4_memory_plan(cfg, weight_bytes: int) -> list[str]:
    """The banner's memory lines for a deepseek_v4 model: weights and the batch state
    (`jlco.model.deepseek_v4.state.state_bytes`, every slot at the full context)."""
    from jlco.engine.v4_runner import state_len
    from jlco.model.deepseek_v4.state import state_bytes
    def mb(b: float) -> str:
        return f"{b / 1e6:.3f} MB"
    batch = cfg.engine.max_batch_size
    parts = state_bytes(cfg.model, state_len(cfg))
    state = batch * sum(parts.values())
    each = ", ".join(f"{k} {mb(v)}" for k, v in parts.items())
    lines = [f"memory: state {mb(state)} + weights {mb(weight_bytes)} (batch {batch}, "
             f"context {cfg.engine.max_context_len}; per request: {each}, replicated on a mesh); "
             "deepseek_v4: MTP, the prefix cache and mesh.data > 1 are not implemented yet"]
    if cfg.cache.offload:
        lines.append(f"memory: csa_entries ({mb(batch * parts['csa_entries'])}) in "
                     f"{cfg.cache.storage} host memory, {cfg.hot_buffer_rows} hot rows per "
                     "request and CSA layer on device")
    return lines


def build_engine(cfg, choice, state, job=None) -> None:
    """Load weights, build the engine, warm it up and hand it to `state` (ready); `job`
    (a `lockstep.Job`) when other processes run the same steps."""
    from jlco.server.loop import EngineLoop
    from jlco.server.text import TextCodec
    state.loading = "loading the model"
    cfg, engine, mesh, weights = _engine(cfg, choice, quiet=False, state=state)
    mcfg = cfg.model
    if choice.checkpoint is not None:
        codec = TextCodec.from_checkpoint(choice.checkpoint)
        if codec is None:
            _say(f"{PROG}: {choice.checkpoint} has no tokenizer.json: prompts must be token ids")
    else:
        codec = TextCodec.byte_level(mcfg.vocab_size)
        _say("tokenizer: byte-level (256 byte tokens + <|endoftext|>) for the random model; "
             "chat template: \"role: content\" lines, then \"assistant: \"")
    state.codec, state.engine = codec, engine
    loop = EngineLoop(engine, max_waiting=cfg.serve.max_queue,
                      import_ttl_s=cfg.serve.import_ttl_s,
                      on_step=state.on_step, mesh=mesh,
                      leader=None if job is None else job.leader)
    if job is not None:
        job.attach(loop)
    loop.start()
    state.loop = loop


def _engine(cfg, choice, *, quiet: bool, state=None):
    """(cfg, engine, mesh, weight bytes): weights loaded into the mesh's shards, the engine
    built and warmed up — the same on every process of a job (process 0 also prints the
    banner's lines)."""
    import jax
    from flax import nnx

    from jlco.engine.core import Engine
    from jlco.launch import load
    say = (lambda _msg: None) if quiet else _say
    mesh = load.checked_mesh(cfg)
    cfg, model = load.load_sharded(choice, cfg, mesh, seed=FLAGS.seed,
                                   verify=FLAGS.verify_checkpoint)
    if mesh is not None:
        say(f"mesh: {dict(mesh.shape)} over {mesh.size} devices (routed experts split over "
            "'expert')")
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))
    for line in memory_plan(cfg, weights) if not quiet else ():
        say(line)
    if state is not None:
        state.loading = "compiling (warm-up)"
    with _mesh_context(mesh):
        engine = Engine(cfg, model)
        say(engine.step_kind.describe())
        _warm_up(engine, say)
    return cfg, engine, mesh, weights


def _mesh_context(mesh):
    import contextlib

    import jax
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def _warm_up(engine, say) -> None:
    """Compile every prefill and decode shape, then serve one small request (stderr
    shows progress and says how long: no request compiles after `ready:`)."""
    if FLAGS.warmup:
        def progress(done, total, what):
            if done % _SHAPES_PER_LINE == 0 or done == total:
                say(f"warm-up: {done}/{total} shapes compiled ({what})")

        w = engine.warm_up(progress)
        say(f"warm-up: {w['seconds']:.1f} s ({w['prefill_shapes']} prefill and "
             f"{w['decode_shapes']} decode shapes compiled, or loaded from the compilation "
             "cache)")


# ----------------------------------------------------------------------------- main


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    compile_cache.enable()
    with cli.errors_exit(PROG, ValueError, OSError, NotImplementedError):
        several = distributed.resolve_from_flags(FLAGS) is not None
        cfg, choice, name = prepare()        # bad input fails before joining the job
        info = distributed.initialize_from_flags(FLAGS) if several else None
        from jlco.launch import load
        load.checked_mesh(cfg)      # the device count must match, before any weight loads
    job = None
    if info is not None:
        _say(f"distributed: {info.describe()}")
        if not info.is_lead:
            return _follow(cfg, choice, info)
        job = _lead(info)
    import uvicorn

    from jlco.server.app import ServerState, create_app
    _say(choice.banner)
    state = ServerState(model_name=name, max_context_len=cfg.engine.max_context_len,
                        api_key=FLAGS.api_key, index_topk=cfg.model.index_topk,
                        tool_call_parser=FLAGS.tool_call_parser,
                        reasoning_parser=FLAGS.reasoning_parser)
    state.job = job
    fastapi_app = create_app(state)
    state.on_step = fastapi_app.state.metrics.observe_step
    failure: list[BaseException] = []

    def load():
        try:
            build_engine(cfg, choice, state, job)
            _say(f"ready: http://{cfg.serve.host}:{server.port}/v1 serving {name!r} "
                 f"(batch {cfg.engine.max_batch_size}, context {cfg.engine.max_context_len}, "
                 f"offload {'on' if cfg.cache.offload else 'off'}"
                 f"{', API key required' if FLAGS.api_key else ''})")
        except BaseException as err:   # noqa: BLE001 - reported below, server stops
            failure.append(err)
            if job is not None:
                job.leader.stop(f"process 0 of {job.num_processes} failed: loading or "
                                f"warming up: {type(err).__name__}: {cli.describe(err)}")
            server.should_exit = True

    server = _Server(uvicorn.Config(fastapi_app, host=cfg.serve.host, port=cfg.serve.port,
                                    log_level="warning",
                                    timeout_graceful_shutdown=FLAGS.grace_s + DRAIN_SLACK_S,
                                    lifespan="off"), state, FLAGS.grace_s)
    def started():
        _say(f"listening: http://{cfg.serve.host}:{server.port} (loading; GET /health is 503 "
             "until ready)")
        threading.Thread(target=load, name="jlco-load", daemon=True).start()

    server.on_started = started
    try:
        server.run()
    finally:
        if state.loop is not None:
            _say(state.loop.drain(FLAGS.grace_s).line())
        if job is not None and not failure:
            job.finish()           # the other processes stop too
        if state.engine is not None:
            state.engine.close()   # the host pool (a "file" pool deletes its file)
    if failure:
        err = failure[0]
        if isinstance(err, (ValueError, OSError, NotImplementedError)):
            cli.fail(PROG, cli.describe(err))
        cli.fail(PROG, f"loading or warming up the model failed: {type(err).__name__}: "
                       f"{cli.describe(err)}", cli.FAILURE_EXIT)
    if server.started_ok is False:
        if job is not None:
            job.leader.stop(f"process 0 could not listen on {cfg.serve.host}:{cfg.serve.port}")
        cli.fail(PROG, f"could not listen on {cfg.serve.host}:{cfg.serve.port}", cli.FAILURE_EXIT)
    if job is not None:
        distributed.shutdown()     # every process leaves the job together
    _say("stopped")


# ----------------------------------------------------------------------------- several processes


def _lead(info):
    """Process 0's `lockstep.Job`: turns out, beats in; a failure ends this process after
    the linger (exit 1, one line naming the process that failed)."""
    def exit_fn(line):
        _say(f"{PROG}: error: {line}")
        os._exit(cli.FAILURE_EXIT)     # a peer is gone: jax's shutdown barrier would hang

    job = lockstep.Job(lockstep.KeyValueChannel(), info.process_count, FLAGS.peer_timeout_s,
                       mark=lambda line: None, exit_fn=exit_fn)
    job.start()
    return job


def _follow(cfg, choice, info) -> None:
    """A process other than 0: the same engine as process 0's, run by its turns; no port,
    no banner. Exit 0 after process 0's clean stop, 1 (one line) if the job failed."""
    me = info.process_index
    follower = lockstep.Follower(lockstep.KeyValueChannel(), me,
                                 leader_timeout_s=FLAGS.peer_timeout_s)
    follower.start_beating()
    signals = []

    def on_signal(sig, frame):
        signals.append(sig)
        if len(signals) > 1:
            _say(f"{PROG}: process {me}: second signal: stopping now")
            os._exit(128 + sig)
        _say(f"{PROG}: process {me}: signal {sig}: waiting for process 0's stop (SIGTERM "
             "process 0 to drain the job; again to stop this process now)")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    engine = None
    try:
        cfg, engine, mesh, _ = _engine(cfg, choice, quiet=True)
        follower.engine = engine
        follower.grammar = lockstep.grammar_maker(choice.checkpoint,
                                                  cfg.model.vocab_size)
        follower.host_pool_bytes = lambda: lockstep.local_host_pool_bytes(engine, mesh)
        _say(f"process {me} of {info.process_count}: ready, running process 0's steps")
        with _mesh_context(mesh):
            follower.run()
    except lockstep.PeerFailed as err:
        _say(f"{PROG}: error: {err}")
        os._exit(cli.FAILURE_EXIT)
    except BaseException as err:   # noqa: BLE001 - process 0 is told, then this one ends
        why = f"{type(err).__name__}: {cli.describe(err)}"
        follower.report_failure(why)
        _say(f"{PROG}: error: process {me} of {info.process_count} failed: {why}")
        os._exit(cli.FAILURE_EXIT)
    engine.close()
    distributed.shutdown()
    _say(f"process {me}: stopped (process 0 drained the job)")


DRAIN_SLACK_S = 10.0   # after the grace: aborted streams send their last event


class _Server:
    """uvicorn's Server, marking the state draining the moment a signal arrives (new
    requests get 503 while open streams finish), and reporting the bound port."""

    def __new__(cls, config, state, grace_s: float):
        import uvicorn

        class Server(uvicorn.Server):
            on_started = None
            started_ok = None

            @property
            def port(self) -> int:
                for srv in getattr(self, "servers", []) or []:
                    for sock in srv.sockets:
                        return sock.getsockname()[1]
                return config.port

            async def startup(self, sockets=None):
                await super().startup(sockets)
                self.started_ok = self.started
                if self.started and self.on_started is not None:
                    self.on_started()

            def handle_exit(self, sig, frame):
                name = 'SIGTERM' if sig == 15 else 'SIGINT' if sig == 2 else sig
                if state.loop is None or state.loop.draining:
                    # not serving yet, or a second signal: stop now
                    super().handle_exit(sig, frame)
                    if hasattr(self, "_captured_signals"):
                        self._captured_signals.clear()
                    return
                # The port stays open while the engine drains, so a new request gets 503
                # (not "connection refused"); the engine aborts what still runs at grace_s,
                # so those streams end with finish_reason "abort", then uvicorn shuts down.
                state.loop.draining = True
                _say(f"{PROG}: {name}: draining (new requests get 503 until the port closes)")

                def drain_then_exit():
                    state.loop.drain(grace_s)
                    self.should_exit = True
                threading.Thread(target=drain_then_exit, name="jlco-drain", daemon=True).start()

        return Server(config)


if __name__ == "__main__":
    pylog.getLogger("jlco.serve").setLevel(pylog.INFO)
    define_flags()
    cli.run_main(main)
