"""tools/bench_vs_transformers.py end to end on the tiny model at --batch 2: both sides
prefill both prompts, the report has each side's prefill and step against the roofline,
the greedy tokens agree per prompt, and the PNG is written; a bad --batch is one line."""

import json

import pytest
from tests.support.cli import ROOT, assert_error, run

pytestmark = pytest.mark.e2e   # real subprocesses: the e2e tier (pyproject.toml)


def test_batch_prefill_against_transformers(tmp_path):
    r = run("tools/bench_vs_transformers.py", f"--config={ROOT / 'configs' / 'tiny.py'}",
            "--batch=2", "--prompt_len=24", "--steps=2", "--prefill_chunk=16",
            f"--out={tmp_path}", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["batch"] == 2 and out["prompt_len"] == 24
    for side in ("jlco", "transformers"):
        assert out[side]["prefill_s"] > 0 and out[side]["step_ms"] > 0
        assert len(out[side]["tokens"]) == 2 and all(len(t) == 3 for t in out[side]["tokens"])
        assert out[f"{side}_prefill_over_roofline"] == out[side]["prefill_s"] / \
            out["roofline_prefill_s"]
    assert out["prefill_speedup"] == out["transformers"]["prefill_s"] / out["jlco"]["prefill_s"]
    assert 0 < out["roofline_prefill_s"] and 0 < out["roofline_step_ms"]
    assert out["same_first_tokens"] == [True, True] and out["same_tokens"]
    assert json.loads((tmp_path / "vs_transformers.json").read_text()) == out
    assert (tmp_path / "vs_transformers.png").stat().st_size > 0


def test_bad_batch_is_one_line():
    assert_error(run("tools/bench_vs_transformers.py", "--batch=0"), 2, "--batch")
