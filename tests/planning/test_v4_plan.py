"""The DeepSeek-V4 memory plan (`jlco.planning.v4`): its parameter count against the
model's own parameters and the published sizes, its cache bytes against what
`init_state` allocates, offload moving exactly CSA's entries, and `jlco.plan` on the V4
deployments."""

import math
import pathlib
import subprocess
import sys

import jax
import pytest
from flax import nnx

from jlco.config import ConfigError, load_config
from jlco.model.deepseek_v4.config import CSA, HCA, SLIDING, V4Config
from jlco.model.deepseek_v4.model import DeepseekV4
from jlco.model.deepseek_v4.state import init_state
from jlco.planning import v4
from jlco.planning.hardware import get_hardware
from jlco.planning.mesh import MeshShape

ROOT = pathlib.Path(__file__).resolve().parents[2]

# every layer type, hash and routed MoE, CSA with its indexer (f32: 4-byte cache values)
TINY = V4Config(vocab_size=300, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=5,
                num_attention_heads=4, head_dim=32, qk_rope_head_dim=8, q_lora_rank=16,
                o_groups=2, o_lora_rank=16, sliding_window=8, compress_rate_csa=4,
                compress_rate_hca=16, index_n_heads=2, index_head_dim=16, index_topk=4,
                n_routed_experts=4, num_experts_per_tok=2, dtype="float32",
                layer_types=(SLIDING, HCA, CSA, HCA, CSA),
                mlp_layer_types=("hash_moe", "moe", "moe", "moe", "moe"))


def test_param_count_is_the_models_own():
    model = nnx.eval_shape(lambda: DeepseekV4(TINY, rngs=nnx.Rngs(0)))
    ours = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model)):
        if "tid2eid" not in jax.tree_util.keystr(path):   # an int table, not a parameter
            ours += math.prod(leaf.shape)
    assert sum(v4.param_counts(TINY).values()) == ours


@pytest.mark.parametrize("config, total_b, active_b", [
    ("configs/deepseek_v4_flash.py", 284, 13),    # the published 284 B / 13 B
    ("configs/deepseek_v4_pro.py", 1600, 49),     # the published 1.6 T / 49 B
])
def test_published_sizes(config, total_b, active_b):
    dep = v4.load_deployment(ROOT / config)
    w = v4.weights(dep.model, "official")
    model_only = w.params_total - v4.mtp_params(dep.model)
    # Flash's published total is the model without its MTP layer, Pro's with it
    assert min(abs(model_only / 1e9 - total_b), abs(w.params_total / 1e9 - total_b)) \
        < 0.02 * total_b
    assert abs(w.params_active / 1e9 - active_b) < 0.05 * active_b


def test_cache_bytes_are_what_init_state_allocates():
    dep = v4.V4Deployment(name="tiny", model=TINY, max_context_len=256, num_draft_tokens=0)
    state = jax.eval_shape(lambda: init_state(TINY, 1, 256))
    allocated = sum(math.prod(x.shape) * x.dtype.itemsize
                    for x in jax.tree_util.tree_leaves(state["layers"]))
    assert v4.per_request_bytes(dep, 256, offload=False)["device"] == allocated


def test_offload_moves_csa_entries_only():
    dep = v4.V4Deployment(name="tiny", model=TINY, max_context_len=256, num_draft_tokens=0)
    off, on = (v4.per_request_bytes(dep, 256, o) for o in (False, True))
    csa_entries = 2 * (256 // 4) * 32 * 4          # 2 CSA layers, [T, D] f32
    hot = 2 * dep.hot_rows * (32 * 4 + 9)
    assert on["host"] == csa_entries and off["host"] == 0
    assert on["device"] == off["device"] - csa_entries + hot
    for kind in (SLIDING, HCA):
        assert on["per_layer"][kind] == off["per_layer"][kind]


def test_v4_is_a_tenth_of_v3_2_per_token_at_1m():
    """The published claim: V4's cache is about a tenth of V3.2's bytes per token at 1M."""
    dep = v4.load_deployment(ROOT / "configs/deepseek_v4_pro.py")
    ratio = v4.cache_bytes_per_token(dep) / v4.v3_2_bytes_per_token()
    assert 0.05 < ratio < 0.25


def test_plan_offload_fits_more_requests():
    dep = v4.load_deployment(ROOT / "configs/deepseek_v4_flash.py")
    p = v4.plan(dep, get_hardware("h200"), mesh=MeshShape(1, 8, 1), context=1 << 20)
    assert p.max_batch_offload > 3 * p.max_batch_no_offload > 0
    with pytest.raises(ValueError, match="tensor"):
        v4.plan(dep, get_hardware("h200"), mesh=MeshShape(1, 1, 2))
    with pytest.raises(ValueError, match="weight_format"):
        v4.weights(dep.model, "fp4")


def test_deployment_checks_its_fields():
    with pytest.raises(ValueError, match="hot_buffer_rows"):
        v4.V4Deployment(name="x", model=TINY, max_context_len=256, hot_buffer_rows=3)
    with pytest.raises(ValueError, match="max_context_len"):
        v4.V4Deployment(name="x", model=TINY, max_context_len=1 << 30)


def _plan(*args):
    return subprocess.run([sys.executable, "-m", "jlco.plan", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.e2e
def test_plan_cli_prints_the_v4_plan():
    r = _plan("--config", "configs/deepseek_v4_pro.py", "--hardware", "h200")
    assert r.returncode == 0, r.stderr
    assert "deepseek_v4_pro (deepseek_v4)" in r.stdout
    for word in ("CSA", "HCA", "largest batch, offload", "hot buffer"):
        assert word in r.stdout
    bad = _plan("--config", "configs/deepseek_v4_pro.py", "--weight_format", "f32")
    assert bad.returncode == 2 and "official" in bad.stderr


def test_a_v4_deployment_is_not_served():
    with pytest.raises(ConfigError, match="jlco.plan"):
        load_config(ROOT / "configs/deepseek_v4_flash.py")
