"""tools/bench_offload_ratio.py end to end on the tiny model: both engines decode the
same tokens with their steps interleaved, the ratios follow from the step times, and the
hot buffer really misses (prompts longer than it); bad flags are one line."""

import json
import statistics

import pytest
from tests.support.cli import ROOT, assert_error, run

pytestmark = pytest.mark.e2e   # real subprocesses: the e2e tier (pyproject.toml)


def test_interleaved_offload_ratio(tmp_path):
    r = run("tools/bench_offload_ratio.py", f"--config={ROOT / 'configs' / 'tiny.py'}",
            "--batch=2", "--prompt_len=80", "--steps=4", f"--out={tmp_path}", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(r.stdout)
    assert rep["tokens_equal"] is True                   # offload on == off
    assert len(rep["off_steps_ms"]) == len(rep["on_steps_ms"]) == 4
    assert rep["ratio_of_p50"] == rep["on_ms_p50"] / rep["off_ms_p50"]
    assert rep["on_ms_p50"] == statistics.median(rep["on_steps_ms"])
    lo, hi = rep["pair_ratio_iqr"]
    assert lo <= rep["pair_ratio_median"] <= hi
    assert 0 < rep["hit_rate"] < 1                       # 80-token prompts, 32-row buffer
    assert rep["hot_buffer_rows"] == rep["topk"] == 32
    assert rep["roofline_ms"] > 0 and rep["on_over_roofline"] > 0
    assert (tmp_path / "bench_offload_ratio.png").stat().st_size > 0


def test_bad_flag_is_one_line():
    assert_error(run("tools/bench_offload_ratio.py", "--batch=0"), 2, "--batch")
