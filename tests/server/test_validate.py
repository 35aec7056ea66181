"""`python -m jlco.validate` as a user runs it: against configs/tiny.py with both servers
started by it (passes, JSON + PNG), against two running servers whose models differ
(the baseline has other random weights: a token mismatch, exit 1, the length named), and
one-line errors for bad flags. The stability judge is also fed hand-made scrapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.cli import assert_error
from tests.support.server import ROOT, TINY_OFFLOAD, ServerProcess

SMALL = ["--num_clients=2", "--num_requests=4", "--prompt_len=40", "--max_tokens=8",
         "--check_max_tokens=6", "--check_limit_cap=200", "--scrape_interval_s=0.2"]


def _validate(*args, timeout=300):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "jlco.validate", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
def test_config_run_passes_and_writes_reports(tmp_path):
    """Both servers started here: baseline, then offload on at batch 4 for the greedy
    prompts and restarted at its budget batch (16, the penalty tables counted) for the load."""
    proc = _validate("--config=configs/tiny.py", *SMALL, f"--out={tmp_path}", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(proc.stdout)
    assert rep == json.loads((tmp_path / "validate.json").read_text())
    assert (tmp_path / "validate.png").stat().st_size > 10_000
    assert "result: PASS" in proc.stderr and "Traceback" not in proc.stderr
    assert rep["ok"] and rep["failures"] == [] and rep["warnings"] == []
    assert (rep["topk"], rep["context"]) == (32, 512)
    rows = rep["correctness"]["lengths"]
    assert [(r["name"], r["prompt_len"]) for r in rows] == [
        ("8", 8), ("topk", 32), ("4topk", 128), ("limit", 200)]      # limit capped
    for r in rows:
        assert r["equal"] and r["offload_ids"] == r["baseline_ids"] and len(r["offload_ids"]) == 6
    sides = rep["benefit"]["sides"]
    assert (sides["offload"]["batch"], sides["baseline"]["batch"]) == (16, 4)
    for s in sides.values():
        assert (s["completed"], s["errors"], s["output_tokens"]) == (4, 0, 32)
    assert rep["benefit"]["ratio"]["output_tokens_per_s"] == pytest.approx(
        sides["offload"]["output_tokens_per_s"] / sides["baseline"]["output_tokens_per_s"])
    stab = {(s["side"], s["batch"]): s for s in rep["stability"]}
    assert set(stab) == {("baseline", 4), ("offload", 4), ("offload", 16)}
    assert stab[("offload", 4)]["phases"] == ["check"] and stab[("offload", 16)]["phases"] == ["load"]
    for s in stab.values():
        assert s["failures"] == [] and s["invariant_violations"] == [] and s["scrapes"] >= 2
        rss = s["metrics"]["process_resident_memory_bytes"]
        assert 0 < rss["first"] <= rss["max"] and rss["slope_per_s"] is not None
    on = stab[("offload", 4)]["metrics"]
    assert on["jlco_leaked_pages"]["last"] == 0 and on["jlco_host_pool_bytes_capacity"]["last"] > 0
    assert "jlco_host_pool_bytes_used" not in stab[("baseline", 4)]["metrics"]   # on device
    for k in ("baseline", "offload"):
        assert all(s["exit"] in (0, None) for s in rep["servers"][k])
    log = (tmp_path / "server_offload.log").read_text()
    assert log.count("ready: http://") == 2 and "(batch 16," in log


@pytest.fixture(scope="module")
def other_weights():
    """Offload on (seed 0) and a baseline with other random weights (seed 1)."""
    on = ServerProcess(*TINY_OFFLOAD)
    base = ServerProcess("--config", str(ROOT / "configs" / "tiny.py"), "--nooffload",
                         "--seed", "1")
    yield on, base
    on.stop()
    base.stop()


@pytest.mark.e2e
def test_mismatch_is_detected_and_named(other_weights, tmp_path):
    on, base = other_weights
    proc = _validate(f"--url={on.url}/v1", f"--baseline_url={base.url}", "--topk=32",
                     "--check_lengths=8,4topk", *SMALL, f"--out={tmp_path}")
    err = assert_error(proc, 1, "jlco.validate: error: correctness: prompt length 8 (8 tokens): "
                       "first differing token at position")
    assert "prompt length 4topk (128 tokens)" in err
    assert len([ln for ln in err.splitlines() if "error:" in ln]) == 1
    assert "result: FAIL" in proc.stdout and "MISMATCH" in proc.stdout
    rep = json.loads((tmp_path / "validate.json").read_text())
    assert not rep["ok"] and not rep["correctness"]["ok"]
    assert [r["equal"] for r in rep["correctness"]["lengths"]] == [False, False]
    assert all(s["started_here"] is False for v in rep["servers"].values() for s in v)
    assert len(rep["stability"]) == 2 and all(not s["failures"] for s in rep["stability"])


@pytest.mark.e2e
def test_topk_read_from_the_servers_models_route(other_weights, tmp_path):
    # Without --config or --topk, the top-k length comes from GET /v1/models' index_topk
    # (tiny: 32); the two servers hold different weights, so it is a mismatch (exit 1).
    on, base = other_weights
    proc = _validate(f"--url={on.url}", f"--baseline_url={base.url}", *SMALL,
                     f"--out={tmp_path}")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "prompt length topk (32 tokens)" in proc.stderr


@pytest.mark.parametrize("args, needle", [
    ([], "give --url and --baseline_url"),
    (["--url=http://127.0.0.1:1"], "--url (offload on) and --baseline_url"),
    (["--url=http://127.0.0.1:1", "--baseline_url=http://127.0.0.1:1/v1"], "the same server"),
    (["--url=localhost:1", "--baseline_url=http://127.0.0.1:2"], "--url=localhost:1: allowed"),
    (["--url=http://127.0.0.1:1", "--baseline_url=http://127.0.0.1:2", "--config=configs/tiny.py"],
     "--config starts them"),
    (["--config=configs/tiny.py", "--check_lengths=8,huge"], "--check_lengths='huge'"),
    (["--config=configs/tiny.py", "--check_lengths=0"], "--check_lengths='0'"),
    (["--config=configs/tiny.py", "--num_clients=0"], "--num_clients=0: allowed"),
    (["--config=configs/tiny.py", "--scrape_interval_s=0"], "--scrape_interval_s=0.0: allowed"),
    (["--config=configs/nope.py"], "nope.py"),
    (["--config=configs/tiny.py", "--override=engine.nope=1"], "has no field 'nope'"),
    (["--config=configs/tiny.py", "--nope"], "nope"),
    (["--url=http://127.0.0.1:1", "--baseline_url=http://127.0.0.1:2", "--topk=32"],
     "cannot reach http://127.0.0.1:"),
])
@pytest.mark.e2e
def test_bad_input_is_one_line(args, needle, tmp_path):
    proc = _validate(*args, f"--out={tmp_path}", timeout=60)
    err = assert_error(proc, 2, "jlco.validate: error:", needle)
    assert len([ln for ln in err.splitlines() if "error" in ln]) == 1, err
    assert proc.stdout == ""


def test_stability_judge_on_made_up_scrapes():
    """A scrape whose hits + misses miss its lookups, and pages still leaked at the end,
    both fail; slopes are least squares over the readings."""
    from jlco.ops.loadgen import Scrape
    from jlco.ops.validate import stability

    def scrape(t, hits, leaked, rss):
        text = (f'jlco_cache_lookups_total{{layer="0"}} 10\njlco_cache_hits_total{{layer="0"}} '
                f'{hits}\njlco_cache_misses_total{{layer="0"}} 4\njlco_leaked_pages {leaked}\n'
                f"process_resident_memory_bytes {rss}\n")
        return Scrape.parse(text, t=t)

    good = stability([scrape(0.0, 6, 0, 100.0), scrape(1.0, 6, 0, 110.0),
                      scrape(2.0, 6, 0, 120.0)])
    assert good["failures"] == [] and good["offload_counters"] and not good["host_pool"]
    rss = good["metrics"]["process_resident_memory_bytes"]
    assert (rss["first"], rss["last"], rss["max"]) == (100.0, 120.0, 120.0)
    assert rss["slope_per_s"] == pytest.approx(10.0)
    bad = stability([scrape(0.0, 6, 0, 100.0), scrape(1.0, 5, 2, 100.0)])
    assert len(bad["failures"]) == 2
    assert bad["failures"][0] == "jlco_leaked_pages ends at 2 (must be 0)"
    assert "layer 0 at 1.0 s: 5 + 4 != 10" in bad["failures"][1]
    assert bad["invariant_violations"] == [dict(scrape=1, t_s=1.0, layer="0", lookups=10.0,
                                                hits=5.0, misses=4.0)]
