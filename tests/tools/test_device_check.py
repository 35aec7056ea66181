"""tools/device_check.sh: its step bookkeeping (fast: a spent budget skips every step),
and the whole CPU dry run (slow)."""
import json
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "device_check.sh"
STEPS = ["a_nvidia_smi", "a_jax_devices", "b_pytest_accelerator", "c_bench_kernels",
         "d_bench_fetch", "d_bench_fetch_path", "e_bench_decode_32k", "f_prefetch_knobs",
         "e_bench_decode_128k"]


def _run(tmp_path, timeout, **env):
    full = {**os.environ, "OUT": str(tmp_path / "dc"), "DEVICE_CHECK_DRY_RUN": "1", **env}
    return subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=timeout, env=full)


def test_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


@pytest.mark.e2e
def test_spent_budget_skips_and_records_every_step(tmp_path):
    proc = _run(tmp_path, 30, DEVICE_CHECK_BUDGET_S="0")
    assert proc.returncode == 1, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "dc" / "summary.json").read_text())
    assert summary["dry_run"] is True and summary["all_ok"] is False
    # the 32K decode step failed (skipped), so its XLA fallback is tried (and skipped) too
    names = [s["name"] for s in summary["steps"]]
    assert names == STEPS[:7] + ["e_bench_decode_32k_xla"] + STEPS[7:]
    for s in summary["steps"]:
        assert s["exit_code"] == 124 and not s["ok"] and "skipped" in s["note"]
        assert (tmp_path / "dc" / s["log"]).is_file()


@pytest.mark.slow
def test_dry_run_every_step_succeeds(tmp_path):
    """DEVICE_CHECK_DRY_RUN=1: the GPU session's script on CPU, tiny shapes (< 3 min);
    run from another directory, all output under $OUT."""
    proc = _run(tmp_path, 400)
    out = tmp_path / "dc"
    summary = json.loads((out / "summary.json").read_text())
    assert proc.returncode == 0, (summary, proc.stderr[-3000:])
    assert [s["name"] for s in summary["steps"]] == STEPS
    assert all(s["exit_code"] == 0 and s["ok"] for s in summary["steps"]), summary
    pytest_step = summary["steps"][2]
    assert pytest_step["raw_exit_code"] in (0, 5)     # all accelerator tests skipped on CPU
    for name in ("bench_kernels.json", "bench_fetch.json", "bench_fetch_path.json",
                 "decode_1024/bench_decode_sweep.json", "decode_2048/bench_decode_sweep.png"):
        assert (out / name).stat().st_size > 0, name
    dec = json.loads((out / "decode_1024" / "bench_decode_sweep.json").read_text())
    assert dec["sweep"][0]["runs"][0]["roofline_fraction"] > 0
    knobs = (out / "f_prefetch_knobs.log").read_text()
    assert "split_attention" in knobs and "prefetch_ahead" in knobs
    assert summary["elapsed_s"] < 300
    assert not (tmp_path / "out").exists()
