"""Planning per device of a mesh, MTP union sizing of the hot buffer, and the indexer-cost
band of the simulator's 128K prediction."""
import dataclasses
import importlib.util
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from jlco.config import ModelConfig, load_config
from jlco.planning import memory, mtp, params, sim_report, trace
from jlco.planning import throughput as sim
from jlco.planning.hardware import get_hardware
from jlco.planning.mesh import MeshShape, host_layout, parse_mesh
from tests.support.cli import assert_error

ROOT = pathlib.Path(__file__).resolve().parents[2]

V32 = load_config(ROOT / "configs" / "deepseek_v32.py")
H200 = get_hardware("h200")
M = ModelConfig()


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "jlco.plan", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


# ------------------------------------------------------------------------- mesh parsing

def test_parse_mesh():
    assert parse_mesh("data=8,expert=8") == MeshShape(8, 8, 1)
    assert parse_mesh(" tensor=2 , data=4 ") == MeshShape(4, 1, 2)
    assert parse_mesh("expert=32").devices == 32
    for bad, needle in (("data=8,exprt=8", "'exprt'"), ("data=0", "'data=0'"),
                        ("data=8,data=2", "twice"), ("expert", "'expert'"),
                        ("tensor=1.5", "'tensor=1.5'"), ("", "--mesh")):
        with pytest.raises(ValueError, match=needle):
            parse_mesh(bad)


def test_host_layout():
    assert host_layout(MeshShape(8, 8, 1), 8).as_dict() == dict(
        devices_per_host=8, hosts=8, devices_on_host=8, attention_ranks_per_host=8)
    assert host_layout(MeshShape(1, 4, 2), 8).attention_ranks_per_host == 4
    assert host_layout(MeshShape(1, 2, 1), 8).hosts == 1
    with pytest.raises(ValueError, match="tensor=3"):
        host_layout(MeshShape(1, 1, 3), 8)


# ------------------------------------------------------------------------- per-device bytes

def test_routed_experts_divide_over_expert():
    w = {e: params.weight_bytes(M, e, "bf16") for e in (1, 4, 8, 32)}
    for e in (4, 8, 32):
        assert w[1].routed_experts == e * w[e].routed_experts
        # nothing else depends on the expert degree (MTP holds its own routed experts)
        assert w[1].attention == w[e].attention and w[1].embed_and_head == w[e].embed_and_head
    assert w[1].mtp - w[8].mtp == (256 - 32) * 3 * 7168 * 2048 * 2


def test_tensor_splits_heads_ffn_vocab_not_low_rank():
    one, two = params.weight_bytes(M, 8, "bf16"), params.weight_bytes(M, 8, "bf16", tensor=2)
    nh, h = M.num_attention_heads, M.hidden_size
    split = (M.q_lora_rank * nh * M.qk_head_dim + M.kv_lora_rank * nh * (M.qk_nope_head_dim
             + M.v_head_dim) + nh * M.v_head_dim * h)            # q_b, kv_b, o_proj
    assert one.attention - two.attention == 61 * 2 * split // 2   # q_a, kv_a replicated
    assert one.dense_ffn == 2 * two.dense_ffn
    assert one.routed_experts == 2 * two.routed_experts           # expert FFN hidden split
    assert one.shared_experts == 2 * two.shared_experts
    assert one.embed_and_head - 2 * h == 2 * (two.embed_and_head - 2 * h)  # final norm stays
    assert one.router_and_norms == two.router_and_norms
    assert two.params_rank < one.params_rank and two.params_total == one.params_total


def test_per_device_plan_scales_with_the_mesh():
    plans = {m: memory.plan(V32, H200, mesh=m, check_transfer=False)
             for m in (MeshShape(1, 8, 1), MeshShape(8, 8, 1), MeshShape(1, 4, 1),
                       MeshShape(1, 8, 2))}
    base, data8 = plans[MeshShape(1, 8, 1)], plans[MeshShape(8, 8, 1)]
    # data replicates weights: every per-device figure is unchanged, hosts multiply
    assert data8.weights == base.weights
    assert (data8.max_batch_offload, data8.max_batch_no_offload) == (
        base.max_batch_offload, base.max_batch_no_offload)
    assert data8.hosts["hosts"] == 8 and base.hosts["hosts"] == 1
    # fewer expert ranks: twice the routed experts, fewer requests fit
    e4 = plans[MeshShape(1, 4, 1)]
    assert e4.weights.routed_experts == 2 * base.weights.routed_experts
    assert e4.max_batch_offload < base.max_batch_offload
    # tensor: less weight per device, the same caches per request (single-head latent and
    # key rows cannot split), so more requests fit; half as many attention ranks per host
    t2 = plans[MeshShape(1, 8, 2)]
    assert t2.weights.total < base.weights.total
    assert t2.per_request_offload == base.per_request_offload
    assert t2.max_batch_offload > base.max_batch_offload
    assert t2.hosts["attention_ranks_per_host"] == base.hosts["attention_ranks_per_host"] // 2
    # the old --ep path is the mesh data=1,expert=ep
    assert memory.plan(V32, H200, ep=8, check_transfer=False) == base
    with pytest.raises(ValueError, match="ep=4 conflicts"):
        memory.plan(V32, H200, ep=4, mesh=MeshShape(1, 8, 1))


def test_host_pool_per_host():
    p = memory.plan(V32, H200, mesh=MeshShape(8, 8, 1), check_transfer=False)
    assert p.host_bytes_per_host == pytest.approx(8 * p.host_bytes_needed)
    per_req = p.per_request_offload["host"] * (1 + V32.cache.host_headroom)
    assert p.host_bytes_per_host_at_max == pytest.approx(8 * p.max_batch_offload * per_req)


@pytest.mark.e2e
def test_cli_deepseek_v32_8x8_plan_prints_per_device_fields():
    r = _cli("--config", "configs/deepseek_v32.py", "--mesh", "data=8,expert=8",
             "--hardware", "h200")
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    for needle in ("mesh data=8 expert=8 tensor=1 (64 devices, 8 host(s) x 8)",
                   "weights per device", "indexer cache", "hot buffer",
                   "largest batch, offload", "largest batch, no offload",
                   "host pool per host"):
        assert needle in out, (needle, out)
    p = memory.plan(V32, H200, mesh=MeshShape(8, 8, 1), check_transfer=False)
    assert f"largest batch, offload    {p.max_batch_offload:6d}" in out
    assert f"largest batch, no offload {p.max_batch_no_offload:6d}" in out
    assert p.max_batch_offload > 3 * p.max_batch_no_offload > 0


def test_default_mesh_precedence():
    from jlco.plan import choose_mesh
    assert choose_mesh(None, 32, False, V32) == MeshShape(1, 32, 1)   # all-1 mesh: --ep
    assert choose_mesh("data=2", 32, False, V32) == MeshShape(2, 1, 1)
    if not hasattr(V32, "mesh"):
        pytest.skip("this config has no mesh section")
    cfg = V32.replace(mesh=dataclasses.replace(V32.mesh, data=2, expert=4))
    assert choose_mesh(None, 32, False, cfg) == MeshShape(2, 4, 1)
    assert choose_mesh(None, 8, True, cfg) == MeshShape(1, 8, 1)      # explicit --ep wins


@pytest.mark.e2e
@pytest.mark.parametrize("mesh,needle", [("data=8,exprt=8", "exprt"), ("data=0", "data=0"),
                                         ("data=2,data=2", "twice"), ("tensor", "tensor")])
def test_cli_bad_mesh_is_one_line(mesh, needle):
    r = _cli("--config", "configs/deepseek_v32.py", "--mesh", mesh)
    err = assert_error(r, 2, "--mesh", needle)
    assert err.strip().count("\n") == 0, err


@pytest.mark.e2e
def test_cli_ep_with_mesh_is_refused():
    err = assert_error(_cli("--config", "configs/deepseek_v32.py", "--mesh", "data=8",
                            "--ep", "8"), 2, "--ep=8", "--mesh")
    assert err.strip().count("\n") == 0


# ------------------------------------------------------------------------- MTP union

def test_union_ratios_by_hand():
    tr = trace.from_sets({(0, 0): [[1, 2, 3, 4], [2, 3, 4, 5], [2, 3, 4, 5], []],
                          (0, 1): [[1, 2, 3, 4], [5, 6, 7, 8], [1, 2, 3, 4], [1, 2, 3, 4]]},
                         dict(topk=4))
    u = trace.union_ratios(tr, window=2)
    assert u["layers"][0] == dict(mean=pytest.approx((5 / 8 + 4 / 8) / 2), p99=pytest.approx(
        0.5 + 0.99 * 0.125), max=5 / 8, n=2)   # the empty record's windows are skipped
    assert u["layers"][1]["max"] == 1.0 and u["layers"][1]["n"] == 3
    assert u["mean_of_layer_max"] == pytest.approx((5 / 8 + 1.0) / 2)
    assert trace.union_ratios(tr)["max"] == 1.0    # window 1: each set over itself


def test_union_fraction_constant_covers_ess_shaped_traces():
    """The constant's measurement, smaller: ESS's overlap profile, 8K context, top-k 512."""
    tr = trace.synthetic_trace(8192, 512, 61, 8, queries_per_step=2, accept=1.35)
    u = trace.union_ratios(tr, warmup=2)
    measured = 2 * u["mean_of_layer_max"] - 1
    assert 0.2 < measured <= mtp.MTP_NEW_FRACTION + 0.02
    assert u["layers"][0]["max"] > 0.9          # layer 0: no locality, as ESS reports


def test_union_rows():
    assert mtp.union_rows(2048, 1) == 2048
    assert mtp.union_rows(2048, 2) == 2868 < 2 * 2048
    assert mtp.union_rows(2048, 3) == 3687 < 3 * 2048
    assert mtp.union_rows(4, 8, new_fraction=1.0) == 32
    with pytest.raises(ValueError, match="s_q="):
        mtp.union_rows(2048, 0)


def test_mtp_union_sizing_shrinks_hot_buffer_and_raises_max_batch():
    cfg = V32.replace(cache__offload=True, engine__num_draft_tokens=2)
    p = memory.plan(cfg, H200, mesh=MeshShape(8, 8, 1), check_transfer=False)
    assert p.hot_rows == mtp.union_rows(2048, 3) < p.hot_rows_engine_min == 3 * 2048
    layers = memory.cache_layers(cfg)
    assert p.per_request_offload["latent_device"] == layers * p.hot_rows * cfg.row_bytes
    assert p.max_batch_offload > p.max_batch_offload_engine_min > 0
    # an explicit hot_buffer_rows is planned as given (what the engine allocates)
    fixed = cfg.replace(cache__hot_buffer_rows=3 * 2048)
    q = memory.plan(fixed, H200, mesh=MeshShape(8, 8, 1), check_transfer=False)
    assert q.hot_rows == 3 * 2048 and q.max_batch_offload == p.max_batch_offload_engine_min


def test_sim_batch_limit_uses_the_union():
    s = sim.Setup(context=131072, num_draft=2, accept=1.7)
    _, b_off = sim.batch_limits(s)
    disjoint = s.context * 61 * s.key_bytes + 3 * 2048 * 61 * s.row_bytes
    assert b_off > int(s.kv_budget // disjoint)


# ------------------------------------------------------------------------- indexer band

@pytest.fixture(scope="module")
def sim_out(h200_sim):
    return h200_sim        # tests/planning/conftest.py: one run per test process


def test_sim_128k_row_carries_the_indexer_band(sim_out):
    u = sim_out["indexer_uncertainty"]
    assert 0 < u["max_abs_residual"] <= 0.07   # calibration within 7 % (test_sim.py)
    assert 0 < u["calibration_indexer_share_min"] <= u["calibration_indexer_share_max"] < 1
    assert u["indexer_rel_uncertainty"] == pytest.approx(
        u["max_abs_residual"] / u["calibration_indexer_share_min"])
    p128 = sim_out["predictions"]["128k_mtp2_accept1.7"]
    p32 = sim_out["predictions"]["32k_mtp4_accept2.8"]
    for key in ("offload", "no_offload"):
        b = p128[key]["band"]
        assert b["node_tokens_s_lo"] < p128[key]["node_tokens_s"] < b["node_tokens_s_hi"]
        assert b["indexer_flops_per_layer"] > 0 and b["indexer_bytes_per_layer"] > 0
    # the indexer's share (and so the band) grows with context
    assert p128["offload"]["band"]["indexer_share"] > p32["offload"]["band"]["indexer_share"]
    assert p128["offload"]["band"]["rel_band"] > p32["offload"]["band"]["rel_band"]
    table = sim_report.format_table(sim_out)
    assert "indexer cost: +-" in table and "offload tok/s band" in table


def test_sim_indexer_op_is_the_roofline():
    from jlco.planning.roofline import indexer_scores
    s = sim.Setup()
    o = sim._ops(s.model, s, 4)
    r = indexer_scores(s.model, s.key_bytes, (s.context,) * 4, s.s_q)
    assert np.all(o["idx_f"] == r["flops"]) and np.all(o["idx_b"] == r["keys"] + r["logits"])


def test_sim_mesh_changes_per_device_prediction():
    small = sim.kv_budget_for(M, MeshShape(1, 8, 1))
    assert small < sim.ESS_KV_BUDGET == sim.kv_budget_for(M, sim.ESS_MESH)
    with pytest.raises(ValueError, match="tensor=2"):
        sim.run("h200", MeshShape(1, 32, 2))


def test_cache_study_union_table():
    spec = importlib.util.spec_from_file_location("cache_study", ROOT / "tools" / "cache_study.py")
    cs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cs)
    tr = trace.from_sets({(0, 0): [[1, 2], [2, 3]]}, dict(topk=2))
    text = cs._union_table(trace.union_ratios(tr, window=2))
    assert "mean of layer max 0.750" in text
