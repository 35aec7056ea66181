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
