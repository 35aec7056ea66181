"""tools/bench_prefill.py end to end on the tiny config: one child per length, each row
with its prefill time, peak RSS and roofline (the module's own for that prompt); bad
flags are one line."""

import json

import pytest
from tests.support.cli import ROOT, assert_error, run

pytestmark = pytest.mark.e2e   # real subprocesses: the e2e tier (pyproject.toml)


def test_rows_have_time_rss_and_roofline(tmp_path):
    js, png = tmp_path / "p.json", tmp_path / "p.png"
    r = run("tools/bench_prefill.py", f"--config={ROOT / 'configs' / 'tiny.py'}",
            "--lengths=40,200", "--rerun_max=40", f"--json_out={js}", f"--png_out={png}",
            "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout)["rows"]
    assert [x["length"] for x in rows] == [40, 200]
    assert rows[0]["method"] == "second run" and rows[0]["warm_s"] == rows[0]["prefill_s"]
    assert rows[1]["warm_s"] is None and rows[1]["prefill_s"] < rows[1]["first_s"]
    for x in rows:
        assert x["tokens_per_s"] == x["length"] / x["prefill_s"]
        assert x["peak_rss_gib"] >= x["base_rss_gib"] > 0
        assert x["over_roofline"] == x["prefill_s"] / x["roofline_s"] > 0
        assert x["roofline_s"] <= x["roofline_as_run_s"]
        assert x["roofline"]["prompt_len"] == x["length"] and x["flops"] > 0
        assert len(x["piece_s"]) == len(x["piece_roofline_s"]) == len(x["roofline"]["pieces"])
        assert sum(x["piece_roofline_s"]) == x["roofline_s"]
    assert rows[1]["flops"] > rows[0]["flops"]
    assert "[200] prefill" in r.stderr and png.stat().st_size > 0


def test_bad_lengths_is_one_line():
    assert_error(run("tools/bench_prefill.py", "--lengths=0,x"), 2, "--lengths")
