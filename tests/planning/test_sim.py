"""The simulator reproduces ESS's five calibration rows and predicts the held-out setups."""
import json

import numpy as np
import pytest

from jlco.planning import throughput as sim


@pytest.fixture(scope="module")
def out():
    return sim.run("h200")


def test_calibration_rows_within_5_percent(out):
    assert len(out["calibration"]) == 5
    for c in out["calibration"]:
        assert abs(c["error_pct"]) <= 5.0, c
        assert c["sim_tokens_s"] == pytest.approx(8 * c["batch"] * c["sim_otps"])
    consts = out["fitted_constants"]
    assert list(consts) == list(sim.FIT_NAMES) and len(consts) <= 5
    for k in ("gemm_eff", "mem_eff", "net_eff"):
        assert 0 < consts[k] <= 1.0


def test_predictions_in_json(out):
    text = json.dumps(out)
    back = json.loads(text)
    assert set(back["predictions"]) == {n for n, *_ in sim.PREDICTIONS}
    for name, p in back["predictions"].items():
        assert p["no_offload"]["node_tokens_s"] > 0 and p["offload"]["node_tokens_s"] > 0
        assert p["batch_limit_offload"] > p["batch_limit_no_offload"] > 0
        assert p["no_offload"]["batch"] == p["batch_limit_no_offload"]
    a28 = back["predictions"]["32k_mtp4_accept2.8"]["no_offload"]["node_tokens_s"]
    a34 = back["predictions"]["32k_mtp4_accept3.4"]["no_offload"]["node_tokens_s"]
    assert a34 == pytest.approx(a28 * 3.4 / 2.8)  # same step, more accepted tokens


def test_step_time_physics():
    s = sim.Setup()
    c = np.array(sim.fitted())
    zero = np.zeros(61)
    t = float(sim.step_time(s, 96, zero, c))
    assert float(sim.step_time(s, 96, zero + 100, c)) == t  # few misses hide (DBA)
    assert float(sim.step_time(s, 96, zero + 20000, c)) > t  # many cannot
    assert float(sim.step_time(s, 128, zero, c)) > t
    no_tbo = s.__class__(tbo=False)
    assert float(sim.step_time(no_tbo, 96, zero, c)) > t
    assert sim.hot_rows_for(s, 52) == s.context  # 52 x 32K fits without offload


def test_plots(out, tmp_path):
    paths = sim.plot(out, str(tmp_path))
    assert len(paths) == 2
    for p in paths:
        assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_sensitivity_section(out):
    """Each predicted setup's sensitivity: every assumption at +20 % and -20 %, sorted by
    the larger effect; faster hardware or more memory never slows the prediction, more
    misses never speed it up."""
    from jlco.planning import sensitivity as sens
    back = json.loads(json.dumps(out, allow_nan=False))
    assert set(back["sensitivity"]) == {n for n, *_ in sim.PREDICTIONS}
    names = [a[0] for a in sens.ASSUMPTIONS]
    for name, s in back["sensitivity"].items():
        assert s["base_node_tokens_s"] == pytest.approx(
            back["predictions"][name]["offload"]["node_tokens_s"])
        entries = {e["assumption"]: e for e in s["entries"]}
        assert sorted(entries) == sorted(names)
        mag = [max(abs(e["plus20_pct"]), abs(e["minus20_pct"])) for e in s["entries"]]
        assert mag == sorted(mag, reverse=True) and mag[0] > 1.0
        for k in ("hbm_bandwidth", "h2d_bandwidth", "network_bandwidth", "fp8_flops",
                  "bf16_flops", "kv_budget", "mem_eff", "indexer_mem_eff"):
            assert entries[k]["plus20_pct"] >= -1e-9 >= entries[k]["minus20_pct"] - 1e-9, k
            assert entries[k]["plus20_no_offload_pct"] >= -1e-9, k
        assert entries["miss_rate"]["plus20_pct"] <= 1e-9 <= entries["miss_rate"]["minus20_pct"]
    # at 128K the step is memory-bound: HBM bandwidth is the largest lever
    top = back["sensitivity"]["128k_mtp2_accept1.7"]["entries"][0]["assumption"]
    assert top in ("hbm_bandwidth", "mem_eff")


def test_sensitivity_scaling_and_errors():
    from jlco.planning import sensitivity as sens
    s, c = sim.Setup(), sim.fitted()
    s2, c2 = sens.scaled(s, c, "hbm_bandwidth", 1.2)
    assert s2.hw.hbm_bw == pytest.approx(1.2 * s.hw.hbm_bw) and c2 == c
    s3, c3 = sens.scaled(s, c, "miss_rate", 0.8)
    assert s3 == s and c3[3] == pytest.approx(0.8 * c[3])
    assert sens.scaled(s, c, "indexer_overlap", 1.2)[0].indexer_overlap == pytest.approx(0.6)
    with pytest.raises(ValueError, match="assumption 'bogus' is invalid"):
        sens.scaled(s, c, "bogus", 1.2)


def test_context_terms_from_first_principles():
    """The indexer op grows linearly with context (keys, FLOPs, logits per position);
    each top-k pass reads the f32 logits once more; the fetch hides behind the other
    micro-batch's indexer only (it needs its own layer's top-k)."""
    from jlco.planning.roofline import indexer_scores
    s, c, b = sim.Setup(), np.array(sim.fitted()), 64
    o32 = sim._ops(s.model, s, b)
    s128 = sim.Setup(context=131072)
    o128 = sim._ops(s.model, s128, b)
    assert o128["idx_f"][0] / o32["idx_f"][0] == pytest.approx(4.0, rel=1e-3)
    assert o128["idx_b"][0] / o32["idx_b"][0] == pytest.approx(4.0, rel=1e-3)
    seen = indexer_scores(s.model, s.key_bytes, (s.context,) * b, s.s_q)["logits"] / 8
    two = sim._ops(s.model, sim.Setup(topk_passes=2.0), b)
    assert two["idx_b"][0] - o32["idx_b"][0] == pytest.approx(4 * seen)
    many = np.full(61, 4000.0)
    t = float(sim.step_time(s, b, many, c))
    assert float(sim.step_time(sim.Setup(indexer_overlap=0.0), b, many, c)) > t
    assert float(sim.step_time(sim.Setup(indexer_overlap=1.0), b, many, c)) < t
