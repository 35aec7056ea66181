"""DeepSeek-V4 on an expert-parallel mesh equals one device.

jax fixes its device count when it initialises, so this runs in a subprocess with 4 CPU
devices (XLA_FLAGS). The tiny reference model (4 experts, k 2; hash and routed layers)
is loaded, then run on one device and, with its parameters placed by their logical axes
(`jlco.parallel.mesh.shard_model`), on the mesh expert=2 x tensor=2: the
stateless forward and a chunked prefill + 6 decode steps must give the same greedy
tokens and logits within 1e-5 (a mesh reorders some f32 sums by about an ulp; a
misrouted token moves logits by 1e-2 or more). The routed experts must run through the
all-to-all dispatch (`jlco.parallel.expert`, counted) with V4's clamped SwiGLU, each
device holding 2 experts and half of each one's hidden units.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, sys, tempfile
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import AxisType, Mesh
    from jlco.checkpoint.deepseek_v4 import load_v4
    from jlco.checkpoint.hf_reference import build_hf_v4_model
    from jlco.model.deepseek_v4 import state as v4_state
    from jlco.parallel.mesh import AXES, shard_model

    from jlco.parallel import expert as expert_parallel
    calls, dispatch = [0], expert_parallel.experts_parallel

    def counted(*args, **kwargs):
        calls[0] += 1
        return dispatch(*args, **kwargs)

    expert_parallel.experts_parallel = counted
    path = tempfile.mkdtemp()
    build_hf_v4_model().save_pretrained(path)
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 21)))

    def run(mesh):
        _, model = load_v4(path, dtype="float32")
        if mesh is None:
            return compute(model)
        shard_model(model, mesh)
        with jax.set_mesh(mesh):
            return compute(model)

    def compute(model):
        full = nnx.jit(lambda m, t: m(t))(model, prompt)   # op by op: minutes on a mesh
        logits, st = v4_state.prefill(model, prompt, max_len=32, chunk=8)
        step = nnx.jit(v4_state.decode_step)
        tok, toks, lgs = jnp.argmax(logits[:, -1], -1), [], []
        for _ in range(6):
            lg, st = step(model, st, tok)
            tok = jnp.argmax(lg, -1)
            toks.append(np.asarray(tok).tolist())
            lgs.append(np.asarray(lg))
        return np.asarray(full), np.stack(lgs), toks

    ref = run(None)
    out = {}
    for e, t in ((2, 2),):
        grid = np.asarray(jax.devices()).reshape(1, e, t)
        before = calls[0]
        got = run(Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 3))
        out[f"{e}x{t}"] = {"forward": float(np.abs(got[0] - ref[0]).max()),
                           "decode": float(np.abs(got[1] - ref[1]).max()),
                           "same_tokens": got[2] == ref[2], "all_to_all": calls[0] - before}
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_expert_parallel_mesh_equals_one_device():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, text=True,
                       capture_output=True, timeout=900, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for mesh, res in out.items():
        assert res["all_to_all"] > 0 and res["same_tokens"], (mesh, res)
        assert res["forward"] <= 1e-5 and res["decode"] <= 1e-5, (mesh, res)
