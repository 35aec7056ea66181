"""The JAX mesh (`jlco.parallel`): expert-parallel decoding equals one device.

jax fixes its device count when it initialises, so every multi-device check runs in a
subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=N (CPU devices):
`python -m jlco.generate --mesh expert=N` (offload on) must give the single-device
tokens exactly and log-probs within LOGPROB_ATOL, for configs/tiny.py's random model
(8 experts, k = 2; also expert=2 x tensor=2) and a 6-expert variant (k = 3: 6 is not a
power of two, on 2 and 3 devices), and with data-parallel attention (data=2, data=4,
data=2 x expert=2); the MoE block alone must lower to all-to-alls; bad meshes end in one
error line. Config, flag parsing and the rules run in-process.

LOGPROB_ATOL: the model is float32; a mesh changes the order of some sums (XLA fuses
and partitions the replicated layers differently, and the expert outputs of a token are
added in dispatch order), each reordering moving a value by about one ulp (~1.2e-7
relative). Measured: at most 4.8e-7 on these runs. 1e-5 leaves 20x room while a real
dispatch bug (a token combined with a wrong expert or weight) moves log-probs by 1e-2
or more on this random model.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jlco.config import Config, ConfigError, MeshConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
LOGPROB_ATOL = 1e-5


def _run(args: list[str], devices: int, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, *args], check=False, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


def _generate(prompts: pathlib.Path, devices: int, *extra: str, offload: bool = True) -> dict:
    r = _run(["-m", "jlco.generate", "--prompts_file", str(prompts), "--max_new_tokens", "6",
              "--offload" if offload else "--nooffload", "--json", *extra], devices)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def _assert_same(got: dict, ref: dict) -> None:
    for g, f in zip(got["results"], ref["results"], strict=True):
        assert g["tokens"] == f["tokens"]
        np.testing.assert_allclose(g["logprobs"], f["logprobs"], rtol=0, atol=LOGPROB_ATOL)


def _assert_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    line = [x for x in r.stderr.splitlines() if x.startswith("jlco.generate: error:")]
    assert len(line) == 1, r.stderr[-3000:]
    for n in needles:
        assert n in line[0], (n, line[0])


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> pathlib.Path:
    """Three prompts (40, 70, 90 tokens: longer than index_topk 32, so offloaded rows
    really move) decoded as one batch of 3: the token count of a decode step (3) is not
    a multiple of 2 or 4 devices, so the token shards are padded."""
    rng = np.random.default_rng(7)
    path = tmp_path_factory.mktemp("mesh") / "prompts.jsonl"
    path.write_text("".join(json.dumps(rng.integers(0, 512, n).tolist()) + "\n"
                            for n in (40, 70, 90)))
    return path


@pytest.fixture(scope="module")
def six_experts(tmp_path_factory) -> pathlib.Path:
    """configs/tiny.py with 6 routed experts in 3 groups, 3 chosen per token."""
    path = tmp_path_factory.mktemp("six") / "six_experts.py"
    path.write_text(textwrap.dedent(f"""\
        import dataclasses
        from jlco.config import load_config
        _tiny = load_config({str(ROOT / "configs" / "tiny.py")!r})
        CONFIG = _tiny.replace(name="six_experts", model=dataclasses.replace(
            _tiny.model, n_routed_experts=6, n_group=3, topk_group=2, num_experts_per_tok=3))
        """))
    return path


@pytest.fixture(scope="module")
def tiny_reference(prompts) -> dict:
    return _generate(prompts, 1)


@pytest.fixture(scope="module")
def six_reference(prompts, six_experts) -> dict:
    return _generate(prompts, 1, "--config", str(six_experts))


# ---- in-process: config section and flag ---------------------------------------------


def test_mesh_config_section():
    assert Config().mesh == MeshConfig(1, 1, 1)
    cfg = Config().replace(mesh__expert=4)
    assert (cfg.mesh.data, cfg.mesh.expert, cfg.mesh.tensor, cfg.mesh.num_devices) == (1, 4, 1, 4)
    for field, bad in (("data", 0), ("expert", -2), ("tensor", 1.5), ("expert", True)):
        with pytest.raises(ConfigError, match=rf"^mesh\.{field}=.* allowed"):
            Config().replace(**{f"mesh__{field}": bad})


def test_parse_mesh_flag():
    from jlco.generate import parse_mesh
    assert parse_mesh("expert=4") == {"mesh__data": 1, "mesh__expert": 4, "mesh__tensor": 1}
    assert parse_mesh("data=1, expert=2,tensor=1")["mesh__expert"] == 2
    for bad in ("expert", "expert=x", "experts=2", "expert=2,expert=2", ""):
        with pytest.raises(ValueError, match="--mesh"):
            parse_mesh(bad)


def test_rules_and_grouped_local_experts():
    """The logical-axis rules, and the grouped (GPU/TPU) local-expert path against the
    dense CPU one (ragged_dot runs on CPU too, only slowly)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jlco.parallel import expert, mesh
    assert mesh.spec_for(("expert", "embed", "mlp")) == P("expert", None, "tensor")
    assert mesh.spec_for(("vocab", "embed"), (10, 4), {"tensor": 3}) == P(None, None)
    assert mesh.spec_for(("vocab", "embed"), (12, 4), {"tensor": 3}) == P("tensor", None)
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    rows = jax.random.normal(ks[0], (11, 16))
    gate, up = (0.3 * jax.random.normal(k, (3, 16, 8)) for k in ks[1:3])
    down = 0.3 * jax.random.normal(ks[3], (3, 8, 16))
    eid = jnp.asarray([2, 0, -1, 1, 1, 2, -1, 0, 0, 2, 1], jnp.int32)
    dense = expert.local_dense(rows, eid, gate, up, down)
    grouped = expert.local_grouped(rows, eid, gate, up, down)
    np.testing.assert_allclose(np.asarray(grouped), np.asarray(dense), rtol=1e-5, atol=1e-6)
    assert not np.asarray(dense)[eid == -1].any() and np.asarray(dense)[eid >= 0].any()


# ---- subprocesses with several CPU devices -------------------------------------------

_MOE_SCRIPT = """
import dataclasses, sys
import jax, jax.numpy as jnp
from flax import nnx
from jlco.config import load_config
from jlco.model.moe import MoE
from jlco.parallel import mesh as pm
experts, k, ep, tp = map(int, sys.argv[1:])
cfg = load_config("configs/tiny.py")
cfg = cfg.replace(mesh__expert=ep, mesh__tensor=tp, model=dataclasses.replace(
    cfg.model, n_routed_experts=experts, n_group=experts // 2, topk_group=2,
    num_experts_per_tok=k))
moe = MoE(cfg.model, rngs=nnx.Rngs(0))
x = jax.random.normal(jax.random.PRNGKey(1), (2, 5, cfg.model.hidden_size))
run = lambda g, st, x: nnx.merge(g, st)(x)
ref = jax.jit(run, static_argnums=0)(*nnx.split(moe), x)
mesh = pm.make_mesh(cfg)
pm.check_mesh(cfg)
pm.shard_model(moe, mesh)
g, st = nnx.split(moe)
gate = moe.experts.gate_proj[...]
assert gate.sharding.spec == jax.P("expert", None, "tensor" if tp > 1 else None), gate.sharding
assert gate.addressable_shards[0].data.shape == (experts // ep, 64, 32 // tp)
with jax.set_mesh(mesh):
    f = jax.jit(run, static_argnums=0)
    text = f.lower(g, st, x).as_text()
    out = f(g, st, x)
print("RESULT", text.count("all_to_all"), text.count("all_reduce"),
      float(jnp.max(jnp.abs(out - ref))), float(jnp.max(jnp.abs(ref))))
"""


@pytest.mark.parametrize("experts,k,ep,tp", [(6, 3, 3, 1),
                                              pytest.param(8, 2, 2, 2, marks=pytest.mark.slow)])
def test_moe_block_dispatches_with_all_to_all(experts, k, ep, tp):
    """The MoE block alone, 10 tokens (padded to a multiple of the expert axis): it lowers
    to three all-to-alls (tokens out, expert ids out, results back), plus a psum over
    "tensor" when the experts' hidden dimension is split, and equals one device."""
    r = _run(["-c", _MOE_SCRIPT, str(experts), str(k), str(ep), str(tp)], ep * tp)
    assert r.returncode == 0, r.stderr[-3000:]
    n_a2a, n_reduce, diff, scale = r.stdout.split("RESULT")[1].split()
    assert int(n_a2a) == 3
    assert (int(n_reduce) > 0) == (tp > 1)
    assert float(scale) > 1e-3 and float(diff) <= 1e-5 * float(scale)


_LOWER_SCRIPT = """
import jax, jax.numpy as jnp
from flax import nnx
from jlco.config import load_config
from jlco.model.moe import MoE
from jlco.parallel import mesh as pm
cfg = load_config("configs/tiny.py").replace(mesh__expert=2)
moe = MoE(cfg.model, rngs=nnx.Rngs(0))
mesh = pm.make_mesh(cfg)
pm.shard_model(moe, mesh)
g, st = nnx.split(moe)
with jax.set_mesh(mesh):
    for plat in ("cuda", "tpu"):
        low = jax.jit(lambda st, x: nnx.merge(g, st)(x)).trace(st, jnp.ones((2, 5, 64))).lower(
            lowering_platforms=(plat,))
        text = low.as_text()
        print("RESULT", plat, text.count("all_to_all"), text.count("ragged_dot"))
"""


def test_expert_parallel_lowers_for_cuda_and_tpu():
    """The accelerator branch (grouped matmuls over the received rows) lowers for cuda
    and tpu from this CPU machine: a broken backend shows up without the hardware."""
    r = _run(["-c", _LOWER_SCRIPT], 2)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [x.split()[1:] for x in r.stdout.splitlines() if x.startswith("RESULT")]
    assert [x[0] for x in lines] == ["cuda", "tpu"]
    assert all(int(a2a) == 3 and int(rd) > 0 for _, a2a, rd in lines), lines


@pytest.mark.parametrize("devices,offload", [pytest.param(2, True, marks=pytest.mark.e2e),
                                             pytest.param(4, True, marks=pytest.mark.slow),
                                             pytest.param(2, False, marks=pytest.mark.slow)])
def test_tiny_expert_parallel_equals_one_device(prompts, tiny_reference, devices, offload):
    """(The reference ran offloaded; offload off gives the same results on one device.)"""
    got = _generate(prompts, devices, "--mesh", f"expert={devices}", offload=offload)
    _assert_same(got, tiny_reference)


@pytest.mark.slow
def test_tiny_expert_parallel_on_8_devices(prompts, tiny_reference):
    _assert_same(_generate(prompts, 8, "--mesh", "data=1,expert=8,tensor=1"), tiny_reference)


@pytest.mark.parametrize("devices", [pytest.param(2, marks=pytest.mark.e2e),
                                     pytest.param(3, marks=pytest.mark.slow)])
def test_six_experts_expert_parallel_equals_one_device(prompts, six_experts, six_reference,
                                                       devices):
    got = _generate(prompts, devices, "--config", str(six_experts), "--mesh", f"expert={devices}")
    _assert_same(got, six_reference)


@pytest.mark.slow
def test_expert_and_tensor_parallel_equals_one_device(prompts, tiny_reference):
    """expert=2 x tensor=2: experts split over "expert" and their hidden dimension over
    "tensor"; attention, dense MLP and LM head tensor-split by XLA's partitioner."""
    _assert_same(_generate(prompts, 4, "--mesh", "expert=2,tensor=2"), tiny_reference)


@pytest.mark.slow
def test_tensor_parallel_alone_equals_one_device(prompts, tiny_reference):
    _assert_same(_generate(prompts, 2, "--mesh", "tensor=2"), tiny_reference)


@pytest.mark.e2e
def test_mesh_product_must_equal_device_count():
    r = _run(["-m", "jlco.generate", "--prompt_ids", "1,2,3", "--mesh", "expert=4"], 2)
    _assert_error(r, "mesh.data=1", "mesh.expert=4", "mesh.tensor=1", "2 device(s)")


@pytest.mark.e2e
def test_experts_must_divide_over_the_mesh(six_experts):
    r = _run(["-m", "jlco.generate", "--prompt_ids", "1,2,3", "--config", str(six_experts),
              "--mesh", "expert=4"], 4)
    _assert_error(r, "model.n_routed_experts=6", "mesh.expert=4")


@pytest.mark.parametrize("devices,mesh", [
    pytest.param(2, "data=2", marks=pytest.mark.e2e),
    pytest.param(4, "data=2,expert=2", marks=pytest.mark.slow),
    pytest.param(4, "data=4", marks=pytest.mark.slow)])
def test_data_parallel_attention_equals_one_device(prompts, tiny_reference, devices, mesh):
    """Three prompts over data ranks (batch rounded up to a multiple of mesh.data): each
    request's attention, hot buffer and host pages live on its rank only."""
    _assert_same(_generate(prompts, devices, "--mesh", mesh), tiny_reference)


@pytest.mark.e2e
def test_data_parallel_batch_must_split_evenly():
    from jlco.config import load_config
    from jlco.parallel.mesh import check_mesh
    cfg = load_config(str(ROOT / "configs" / "tiny.py")).replace(mesh__data=3)
    with pytest.raises(ValueError, match=r"engine.max_batch_size=4 is not divisible by mesh.data=3"):
        check_mesh(cfg)
    check_mesh(cfg.replace(engine__max_batch_size=6))   # 2 slots per rank
    # jlco.generate rounds its batch up to a multiple of mesh.data instead.
    r = _run(["-m", "jlco.generate", "--prompt_ids", "1,2,3", "--max_new_tokens", "2",
              "--mesh", "data=3"], 3)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "batch 3," in r.stderr and "'data': 3" in r.stderr
