"""tools/tune.py over the prefetch scheduler's knobs: the grid takes split_attention,
prefetch_ahead and prefetch_depth (left out: the config's), "auto" chunk and depth
values; combinations the config refuses (host-driven knobs on the in-jit path) are not
candidates; a sweep reports what "auto" resolved to and the health counters, as JSON
and as a table, with every candidate's tokens equal to the reference."""

import dataclasses
import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from jlco.config import load_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("tune", ROOT / "tools" / "tune.py")
tune = importlib.util.module_from_spec(_spec)
sys.modules["tune"] = tune
_spec.loader.exec_module(tune)

TINY = load_config(ROOT / "configs" / "tiny.py")
GRID = dict(fetch_chunk_rows=["auto", 16], prefetch_threads=[2], hot_buffer_rows=[32],
            eviction=["lru"], fetch_path=["in_jit", "host_driven"], storage=["pinned_host"],
            prefetch_ahead=[False, True], prefetch_depth=["auto", 2])


def test_grid_with_the_scheduler_knobs():
    cands = tune.candidates(TINY, GRID)
    ks = [tune.knobs(c) for c in cands]
    # in_jit: prefetch off only (2 chunks x 2 depths); host_driven: both (2 x 2 x 2)
    assert len(ks) == 4 + 8 and len({tuple(k.values()) for k in ks}) == 12
    assert not any(k["prefetch_ahead"] and k["fetch_path"] == "in_jit" for k in ks)
    assert all(k["split_attention"] is False for k in ks)          # left out: the config's
    assert {k["fetch_chunk_rows"] for k in ks} == {"auto", 16}


def test_flag_values_are_parsed_and_checked():
    assert tune._auto_or_ints("prefetch_depth", ["auto", "3"]) == ["auto", 3]
    assert tune._bools("prefetch_ahead", ["true", "False"], False) == [True, False]
    assert tune._bools("prefetch_ahead", [], True) == [True]
    with pytest.raises(ValueError, match="--prefetch_ahead=yes"):
        tune._bools("prefetch_ahead", ["yes"], False)
    with pytest.raises(ValueError, match="--fetch_chunk_rows=big"):
        tune._auto_or_ints("fetch_chunk_rows", ["big"])


@pytest.mark.e2e
def test_sweep_reports_the_derived_values(tmp_path):
    """The CLI on a 2-layer model: chunk auto vs 16, prefetch off vs on (depth auto),
    host-driven: JSON with each trial's derived chunk/depth and health counters; the
    table lists every candidate; tokens equal the offload-off reference."""
    small = TINY.replace(model=dataclasses.replace(
        TINY.model, num_hidden_layers=2, num_nextn_predict_layers=0, index_topk=16),
        engine__max_context_len=64, engine__max_batch_size=2, name="tiny2")
    cfg_path = tmp_path / "tiny2.py"
    tune.write_config(small, cfg_path)
    base = [sys.executable, str(ROOT / "tools" / "tune.py"), f"--config={cfg_path}",
            "--fetch_chunk_rows=auto,16", "--hot_buffer_rows=2x", "--eviction=lru",
            "--fetch_path=host_driven", "--prefetch_ahead=false,true", "--num_requests=2",
            "--max_trials=4", "--repeats=1", "--prompt_len=40", "--gen_len=4"]
    res = subprocess.run(base + ["--json"], capture_output=True, text=True, timeout=600,
                         cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout)
    trials = report["trials"]
    assert len(trials) == 4 and all(t["status"] == "ok" and t["tokens_match"] for t in trials)
    for t in trials:
        d, k, h = t["derived"], t["knobs"], t["health"]
        assert d["fetch_chunk_rows"] >= 64 if k["fetch_chunk_rows"] == "auto" \
            else d["fetch_chunk_rows"] == 16
        assert (d["prefetch_depth"] is not None) == k["prefetch_ahead"]
        assert h["rows_needed"] == h["rows_hit"] + h["rows_prefetched_used"] + h["rows_on_demand"]
        assert (h["rows_predicted"] > 0) == k["prefetch_ahead"]
    table = subprocess.run(base, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert table.returncode == 0, table.stderr[-3000:]
    assert "depth" in table.stdout.splitlines()[0] and table.stdout.count(" same ") == 4
