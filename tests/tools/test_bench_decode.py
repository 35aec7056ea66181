"""tools/bench_decode.py end to end on a tiny setting (default mode, --small
--sweep_contexts from outside the repository, one-line flag errors), and synthetic
admission."""
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from jlco.config import load_config
from jlco.engine import synthetic
from jlco.engine.core import Engine, RequestError
from jlco.model.decoder import DeepseekV32
from jlco.planning import roofline

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bench(*args, cwd=ROOT, timeout=170):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(ROOT / "tools/bench_decode.py"), *args],
                          cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.e2e
def test_bench_decode_runs_and_reports(tmp_path):
    proc = _bench("--contexts=512", "--steps=2", "--warmup=1", "--layers=1", "--topk=32",
                  "--device_budget_gb=0.006", f"--out={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rep = json.loads((tmp_path / "bench_decode.json").read_text())
    assert (tmp_path / "bench_decode.png").stat().st_size > 0
    assert "offload/baseline step time" in proc.stdout
    assert rep["mode"] == "contexts" and rep["roofline_machine"]["name"] == "cpu"
    (c,) = rep["contexts"]
    assert c["context"] == 512
    per = c["device_bytes_per_request"]
    # 1 layer x (512 + 1 warm-up + 2 steps + 2) positions: baseline (656 + 132) B, offload 132 B + 64 hot rows x 656 B
    assert per["baseline"] == 517 * 788 and per["offload"] == 517 * 132 + 64 * 656
    assert c["max_batch"]["offload"] > c["max_batch"]["baseline"] >= 1
    assert c["batch_ratio"] == c["max_batch"]["offload"] / c["max_batch"]["baseline"]
    runs = {(r["offload"], r["batch"]): r for r in c["runs"]}
    assert (False, c["same_batch"]) in runs and (True, c["same_batch"]) in runs
    assert (True, c["max_batch"]["offload"]) in runs
    for r in c["runs"]:
        assert len(r["step_s"]) == 2 and r["step_s_median"] > 0 and r["tokens_per_s"] > 0
        # The roofline beside the measurement: the measured CPU figures by default.
        roof = r["roofline"]
        assert r["roofline_bytes"] == roof["total_bytes"] > 0
        assert roof["contexts"] == [512 + 1] * r["batch"]     # context + 1 warm-up token
        m = rep["roofline_machine"]     # measured on this machine unless flags give it
        assert r["roofline_s"] == pytest.approx(max(
            roof["total_bytes"] / (m["mem_gbps"] * 1e9),
            roof["total_flops"] / (m["peak_tflops"] * 1e12)), rel=1e-12)
        assert r["roofline_fraction"] == r["roofline_s"] / r["step_s_median"]
        assert 0 < r["roofline_fraction"] < 1
        assert r["xla_bytes"] > 0 and r["xla_flops"] > 0      # XLA's cost of the jitted step
        if r["offload"]:
            assert 0.0 <= r["hit_rate"] <= 1.0 and r["h2d_bytes_per_token"] >= 0
            assert r["device_bytes_per_request"] < per["baseline"]
    assert c["same_batch_step_ratio"] > 0 and c["tokens_per_s_ratio"] > 0


@pytest.mark.e2e
def test_sweep_small_writes_json_and_png_from_outside_the_repository(tmp_path):
    """--small --sweep_contexts, run from another directory (configs/ found in the
    repository), --json on stdout, JSON + PNG in --out."""
    out = tmp_path / "res"
    proc = _bench("--small", "--sweep_contexts=1024,2048", f"--out={out}", "--json",
                  cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rep = json.loads(proc.stdout)
    assert rep == json.loads((out / "bench_decode_sweep.json").read_text())
    assert (out / "bench_decode_sweep.png").stat().st_size > 0
    assert "offload/baseline step time" in proc.stderr       # the table, on stderr
    assert rep["mode"] == "sweep" and rep["topk"] == 64
    assert [c["context"] for c in rep["sweep"]] == [1024, 2048]
    for c in rep["sweep"]:
        base, off = c["runs"]
        assert (base["offload"], off["offload"]) == (False, True)
        assert base["batch"] == off["batch"] == c["batch"] == 2
        assert len(base["step_s"]) == 2 and base["roofline"]["contexts"] == [c["context"] + 1] * 2
        assert c["offload_over_baseline"] == off["step_s_median"] / base["step_s_median"]
        for r in c["runs"]:
            assert 0 < r["roofline_fraction"] < 1 and r["xla_bytes"] > 0
    # More context, more bytes to touch (indexer keys) at the same batch and top-k.
    assert rep["sweep"][1]["roofline_bytes"] > rep["sweep"][0]["roofline_bytes"]
    assert not list(tmp_path.glob("out"))                  # nothing written to cwd/out


@pytest.mark.e2e
@pytest.mark.parametrize("args, needle", [
    (["--impl=pallas"], "use --impl=interpret (Pallas interpret mode, slow) or --impl=xla"),
    (["--steps=x"], "--steps"),
    (["--sweep_contexts=1024,-2"], "--sweep_contexts=1024,-2: allowed positive integers"),
    (["--set=model__no_such_field=1"], "--set"),
])
def test_bad_flags_fail_in_one_line(args, needle):
    proc = _bench(*args, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_decode: error: "), lines
    assert needle in lines[0]


def test_admit_prefilled_offload_equals_on_device():
    """A synthetic context admitted into both engines decodes the same tokens, its
    pages come back at the end, and misfits are refused by name."""
    cfg = load_config(ROOT / "configs/tiny.py").replace(
        engine__max_batch_size=2, engine__max_context_len=128)
    model = DeepseekV32(cfg.model, rngs=nnx.Rngs(0))
    toks = []
    for offload in (False, True):
        c = cfg.replace(cache__offload=offload)
        eng = Engine(c, model, impl="xla")
        reqs = [synthetic.admit_prefilled(
            eng, synthetic.synthetic_cache(c, jax.random.PRNGKey(i), n=100 + i, max_len=128),
            max_new_tokens=5, first_token=3) for i in range(2)]
        assert int(eng.runner.cache.lengths[1]) == 101
        eng.run()
        assert all(r.status == "finished" and len(r.tokens) == 5 for r in reqs)
        eng.check_no_leaks()
        if offload:
            assert eng.scheduler.pages.free_pages == eng.scheduler.pages.num_pages
            assert eng.metrics.snapshot()["total"]["lookups"] > 0
        toks.append([r.tokens for r in reqs])
    assert toks[0] == toks[1]
    temp = synthetic.synthetic_cache(cfg, jax.random.PRNGKey(0), n=100, max_len=128)
    with pytest.raises(RequestError, match="max_new_tokens 40 exceeds"):
        synthetic.admit_prefilled(eng, temp, max_new_tokens=40)
    assert np.asarray(temp.lengths).tolist() == [100]
