"""tools/bench_host_overhead.py end to end on the tiny model: every row has its step,
host time, host share and roofline ratio; bad flags are one line."""

import json

import pytest
from tests.support.cli import ROOT, assert_error, run

pytestmark = pytest.mark.e2e   # real subprocesses: the e2e tier (pyproject.toml)


def test_reports_host_share_and_roofline(tmp_path):
    r = run("tools/bench_host_overhead.py", f"--config={ROOT / 'configs' / 'tiny.py'}",
            "--batches=1,2", "--active=1", "--prompt_len=20", "--steps=3",
            f"--out={tmp_path}", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)["rows"]
    assert [x["batch"] for x in rows] == [1, 2] and all(x["active"] == 1 for x in rows)
    for x in rows:
        assert 0 < x["host_ms_p50"] < x["step_ms_p50"]
        assert x["host_share"] == x["host_ms_p50"] / x["step_ms_p50"]
        assert x["roofline_ms"] > 0 and x["step_over_roofline"] > 0
    assert (tmp_path / "bench_host_overhead.png").stat().st_size > 0


def test_bad_batches_is_one_line():
    assert_error(run("tools/bench_host_overhead.py", "--batches=0,x"), 2, "--batches")
