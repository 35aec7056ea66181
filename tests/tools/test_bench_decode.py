"""tools/bench_decode.py end to end on a tiny setting, and synthetic admission."""
import json
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

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_bench_decode_runs_and_reports(tmp_path):
    out = tmp_path / "b.json"
    cmd = [sys.executable, "tools/bench_decode.py", "--contexts=512", "--steps=2",
           "--warmup=1", "--layers=1", "--topk=32", "--device_budget_gb=0.006",
           f"--out={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert (tmp_path / "b.png").stat().st_size > 0
    assert "offload/baseline step time" in proc.stdout
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
        if r["offload"]:
            assert 0.0 <= r["hit_rate"] <= 1.0 and r["h2d_bytes_per_token"] >= 0
            assert r["device_bytes_per_request"] < per["baseline"]
    assert c["same_batch_step_ratio"] > 0 and c["tokens_per_s_ratio"] > 0


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
