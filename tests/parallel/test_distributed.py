"""Several processes, one device set (`jlco.parallel.distributed`): the flag and
environment checks, then two real local processes joined through a coordinator on
127.0.0.1 running cross-process collectives, and `jlco.generate` on a mesh that spans
both processes giving the tokens of one device."""

from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

from jlco.parallel import distributed

ROOT = pathlib.Path(__file__).resolve().parents[2]

# One process of a two-process job: 2 CPU devices each, 4 in all. Each process holds
# the values 2p+1, 2p+2 on its devices; the sum over the mesh is 1+2+3+4 = 10.
WORKER = """
import json, sys
import numpy as np
from jlco.parallel import distributed
info = distributed.initialize(timeout_s=60)     # everything from JAX_* variables
import jax
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((jax.device_count(),), ("x",))
p = jax.process_index()
local = np.arange(2 * p + 1, 2 * p + 1 + jax.local_device_count(), dtype=np.float32)
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), local)
total = jax.jit(jax.shard_map(lambda b: jax.lax.psum(b, "x"), mesh=mesh, in_specs=P("x"),
                              out_specs=P()))(x)
gathered = jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, P()))(x)
print(json.dumps({"info": [info.process_index, info.process_count, info.local_devices,
                           info.global_devices],
                  "device_processes": sorted({d.process_index for d in jax.devices()}),
                  "sum": np.asarray(total).tolist(), "gathered": np.asarray(gathered).tolist()}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", **extra)
    return env


def _run_job(cmds: list[list[str]], envs: list[dict], timeout_s: float):
    """Run the processes of one job together; all are killed if any fails or the job
    outlives `timeout_s`. [(returncode, stdout, stderr)] in process order."""
    procs = [subprocess.Popen(c, cwd=ROOT, env=e, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for c, e in zip(cmds, envs)]
    try:
        outs = [p.communicate(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return [(p.returncode, o, e) for p, (o, e) in zip(procs, outs)]


# ----------------------------------------------------------------------------- checks


def test_one_process_is_the_default_and_touches_nothing():
    assert distributed.resolve(environ={}) is None
    assert distributed.resolve(num_processes=1, process_id=0, environ={}) is None
    assert distributed.resolve(num_processes="1",
                               environ={"JAX_COORDINATOR_ADDRESS": "h:1"}) is None


def test_explicit_values_and_environment_fallbacks():
    req = distributed.resolve("10.0.0.1:1234", "2", 1, "0,1", environ={})
    assert req == distributed.Request("10.0.0.1:1234", 2, 1, (0, 1), auto=False)
    env = {"JAX_COORDINATOR_ADDRESS": "[::1]:80", "JAX_NUM_PROCESSES": "4",
           "JAX_PROCESS_ID": "3"}
    assert distributed.resolve(environ=env) == distributed.Request("[::1]:80", 4, 3, None)
    # a flag wins over its environment variable
    assert distributed.resolve(process_id=0, environ=env).process_id == 0
    auto = distributed.resolve(num_processes="auto", environ={})
    assert auto == distributed.Request(None, None, None, None, auto=True)


@pytest.mark.parametrize("kw, message", [
    (dict(num_processes="two"), "--num_processes='two' is invalid: allowed a positive "
                                "integer or 'auto'"),
    (dict(num_processes=0), "--num_processes=0 is invalid: allowed a positive integer"),
    (dict(num_processes=2, process_id=0), "--coordinator_address is required with "
                                          "--num_processes=2: allowed host:port"),
    (dict(num_processes=2, coordinator_address="h:1"), "--process_id is required with "
                                                       "--num_processes=2: allowed 0..1"),
    (dict(num_processes=2, coordinator_address="h:1", process_id=2),
     "--process_id=2 is invalid: allowed 0..1 (--num_processes=2)"),
    (dict(num_processes=2, coordinator_address="h:1", process_id=-1),
     "--process_id=-1 is invalid: allowed 0..1"),
    (dict(num_processes=2, coordinator_address="h", process_id=0),
     "--coordinator_address='h' is invalid: allowed host:port with a port in 1..65535"),
    (dict(num_processes=2, coordinator_address="h:70000", process_id=0),
     "--coordinator_address='h:70000' is invalid"),
    (dict(num_processes=2, coordinator_address="h:1", process_id=0, local_device_ids="0,a"),
     "--local_device_ids='a' is invalid: allowed comma-separated device ids >= 0"),
    (dict(process_id=1), "--process_id=1 is invalid"),
])
def test_bad_values_are_one_line_errors_naming_the_flag(kw, message):
    with pytest.raises(ValueError) as err:
        distributed.resolve(environ={}, **kw)
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


def test_bad_environment_values_name_the_variable():
    env = {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "5", "JAX_COORDINATOR_ADDRESS": "h:1"}
    with pytest.raises(ValueError, match=r"^JAX_PROCESS_ID=5 is invalid: allowed 0\.\.1 "
                                         r"\(JAX_NUM_PROCESSES=2\)$"):
        distributed.resolve(environ=env)


def test_multi_process_asked():
    assert distributed.multi_process_asked(None, environ={}) is None
    assert distributed.multi_process_asked("1", environ={}) is None
    assert distributed.multi_process_asked("2", environ={}) == "--num_processes=2"
    assert distributed.multi_process_asked(None, {"JAX_NUM_PROCESSES": "auto"}) == \
        "JAX_NUM_PROCESSES=auto"


@pytest.mark.e2e
def test_generate_refuses_a_job_without_a_coordinator():
    r = subprocess.run([sys.executable, "-m", "jlco.generate", "--prompt_ids", "1,2",
                        "--num_processes", "2", "--process_id", "0"], cwd=ROOT,
                       env=_env(1), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip() == ("jlco.generate: error: --coordinator_address is required "
                                "with --num_processes=2: allowed host:port of process 0 (or "
                                "set JAX_COORDINATOR_ADDRESS)")


@pytest.mark.e2e
def test_generate_checks_its_input_before_joining_the_job():
    """No coordinator listens at 127.0.0.1:1: the bad prompt is reported at once."""
    r = subprocess.run([sys.executable, "-m", "jlco.generate", "--prompt_ids", "1,x",
                        "--num_processes", "2", "--process_id", "1", "--coordinator_address",
                        "127.0.0.1:1", "--distributed_timeout_s", "600"], cwd=ROOT,
                       env=_env(1), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().startswith("jlco.generate: error: --prompt_ids='1,x' is invalid")


@pytest.mark.e2e
def test_serve_checks_its_input_before_joining_the_job():
    """No coordinator listens at 127.0.0.1:1: the bad override is reported at once, and
    a job without a coordinator address is refused naming the flag."""
    r = subprocess.run([sys.executable, "-m", "jlco.serve", "--config",
                        str(ROOT / "configs" / "tiny.py"), "--num_processes", "2",
                        "--process_id", "1", "--coordinator_address", "127.0.0.1:1",
                        "--override", "engine.max_batch_size=0"],
                       cwd=ROOT, env=_env(1), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().startswith("jlco.serve: error: engine.max_batch_size=0"), r.stderr
    r = subprocess.run([sys.executable, "-m", "jlco.serve", "--num_processes", "2",
                        "--process_id", "0"], cwd=ROOT, env=_env(1), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip() == ("jlco.serve: error: --coordinator_address is required "
                                "with --num_processes=2: allowed host:port of process 0 (or "
                                "set JAX_COORDINATOR_ADDRESS)")


# ----------------------------------------------------------------------------- two processes


def test_two_processes_form_one_mesh_and_reduce_across_it():
    addr = f"127.0.0.1:{_free_port()}"
    envs = [_env(2, JAX_COORDINATOR_ADDRESS=addr, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(p))
            for p in range(2)]
    runs = _run_job([[sys.executable, "-c", WORKER]] * 2, envs, timeout_s=180)
    for p, (code, out, err) in enumerate(runs):
        assert code == 0, f"process {p}: {err[-3000:]}"
        got = json.loads(out.strip().splitlines()[-1])
        assert got["info"] == [p, 2, 2, 4]
        assert got["device_processes"] == [0, 1]
        assert got["sum"] == [10.0]
        assert got["gathered"] == [1.0, 2.0, 3.0, 4.0]


def _generate_args(prompt: list[int], source: list[str]) -> list[str]:
    return [sys.executable, "-m", "jlco.generate", *source, "--offload", "--prompt_ids",
            ",".join(map(str, prompt)), "--max_new_tokens", "4", "--json"]


def _six_expert_checkpoint(tmp_path) -> list[str]:
    from tests.support.cli import make_hf_checkpoint
    make_hf_checkpoint(tmp_path / "six", n_routed_experts=6, n_group=2, topk_group=1,
                       num_experts_per_tok=3)
    return ["--checkpoint", str(tmp_path / "six")]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["random", "hf_checkpoint"])
def test_generate_on_a_mesh_across_two_processes_matches_one_device(model, tmp_path):
    """expert=2 over two processes of one CPU device each: process 0 prints the JSON of
    one device (gloo's connection lines kept off stdout), process 1 prints nothing. The
    checkpoint (6 experts, made by transformers) loads straight into its shards."""
    source = (["--config", str(ROOT / "configs" / "tiny.py")] if model == "random"
              else _six_expert_checkpoint(tmp_path))
    prompt = [(11 * j + 2) % 250 for j in range(40)]    # longer than index_topk: rows move
    one = subprocess.run(_generate_args(prompt, source), cwd=ROOT, env=_env(1),
                         capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    want = json.loads(one.stdout)
    addr = f"127.0.0.1:{_free_port()}"
    cmds = [_generate_args(prompt, source) + [
        "--mesh", "expert=2", "--num_processes", "2", "--process_id", str(p),
        "--coordinator_address", addr, "--distributed_timeout_s", "120"] for p in range(2)]
    (c0, out0, err0), (c1, out1, err1) = _run_job(cmds, [_env(1), _env(1)], timeout_s=600)
    assert c0 == 0 and c1 == 0, err0[-3000:] + err1[-3000:]
    got = json.loads(out0)
    assert got["tokens"] == want["tokens"]
    assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"])) < 1e-5
    assert out1 == ""
    assert "distributed: process 0 of 2: 1 local of 2 devices" in err0
    assert "mesh {'data': 1, 'expert': 2, 'tensor': 1}" in err0
    assert int(re.search(r"H2D (\d+) B", err0).group(1)) > 0
