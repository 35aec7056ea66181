"""tools/bench_vs_llamacpp.py: flag errors in one line, the machine probe it divides by,
and (where the optional llama.cpp extra and its converter are present) one tiny run of
both engines end to end."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from jlco.planning import probe

ROOT = pathlib.Path(__file__).resolve().parents[2]
SRC = os.environ.get("LLAMA_CPP_SRC", "")


def _bench(*args, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(ROOT / "tools/bench_vs_llamacpp.py"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.e2e
def test_bad_contexts_flag_is_named():
    proc = _bench("--contexts=2k")
    assert proc.returncode == 2
    assert "--contexts=2k: allowed positive integers" in proc.stderr


def test_probe_measures_this_machine():
    assert probe.read_gbps(8 << 20, repeats=3) > 0.5
    assert probe.matmul_gflops(256, repeats=2) > 0.5
    caches = probe.cache_sizes()
    if os.path.exists("/sys/devices/system/cpu/cpu0/cache"):
        assert "L1d" in caches and caches["L1d"].endswith("K")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(os.path.join(SRC, "convert_hf_to_gguf.py")),
                    reason="needs LLAMA_CPP_SRC: a llama.cpp tree with its converter")
def test_both_engines_compute_the_same_tokens(tmp_path):
    pytest.importorskip("llama_cpp", reason="the optional [llamacpp] extra")
    proc = _bench("--contexts=256", "--batches=1,2", "--new_tokens=4", f"--out={tmp_path}",
                  f"--llama_cpp_src={SRC}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads((tmp_path / "vs_llamacpp.json").read_text())
    assert (tmp_path / "vs_llamacpp.png").stat().st_size > 0
    assert [(r["context"], r["batch"]) for r in rep["results"]] == [(256, 1), (256, 2)]
    for r in rep["results"]:
        assert all(r["same_first_tokens"]), r
        for side in ("jlco", "llamacpp"):
            assert r[side]["decode_tok_s"] > 0 and r[side]["step_over_roofline"] >= 1.0


def _run_json(path, context, gbps, kv_type="f32"):
    side = dict(prefill_s=2.0, prefill_tok_s=context / 2.0, step_ms=8.0, decode_tok_s=125.0,
                tokens=[[1, 2]], prefill_over_roofline=2.0, step_over_roofline=2.5)
    result = dict(context=context, batch=1, jlco=side,
                  llamacpp=dict(side, prefill_s=3.0, step_ms=10.0, decode_tok_s=100.0),
                  roofline_prefill_s=1.0, roofline_step_ms=3.2, prefill_speedup=1.5,
                  decode_speedup=1.25, same_first_tokens=[True], same_tokens=True)
    path.write_text(json.dumps(dict(
        config="configs/bench_llamacpp.py", overrides=[], new_tokens=2, rounds=1,
        kv_type=kv_type, results=[result],
        machine=dict(mem_gbps=gbps, working_set_mb=143.0, peak_gflops=130.0))))
    return str(path)


@pytest.mark.e2e
def test_merge_keeps_each_runs_machine(tmp_path):
    a, b = _run_json(tmp_path / "a.json", 2048, 23.9), _run_json(tmp_path / "b.json", 8192, 21.0)
    proc = _bench(f"--merge={a},{b}", f"--out={tmp_path / 'all'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads((tmp_path / "all" / "vs_llamacpp.json").read_text())
    assert [r["context"] for r in rep["results"]] == [2048, 8192]
    assert [r["machine"]["mem_gbps"] for r in rep["results"]] == [23.9, 21.0]
    assert rep["merged_from"] == [a, b] and rep["rounds"] == [1, 1]
    assert "2048: 23.9 GB/s" in proc.stdout and "8192: 21.0 GB/s" in proc.stdout
    assert (tmp_path / "all" / "vs_llamacpp.png").stat().st_size > 0


@pytest.mark.e2e
def test_merge_refuses_runs_that_differ(tmp_path):
    a = _run_json(tmp_path / "a.json", 2048, 23.9)
    b = _run_json(tmp_path / "b.json", 8192, 21.0, kv_type="f16")
    proc = _bench(f"--merge={a},{b}", f"--out={tmp_path / 'all'}")
    assert proc.returncode == 2 and "the runs differ in 'kv_type'" in proc.stderr
    proc = _bench(f"--merge={tmp_path / 'missing.json'}", f"--out={tmp_path / 'all'}")
    assert proc.returncode == 2 and "cannot read" in proc.stderr


@pytest.mark.e2e
def test_bad_child_spec_is_named():
    proc = _bench("--child=vllm:2048:1:/tmp")
    assert proc.returncode == 2 and "--child=vllm:2048:1:/tmp: allowed ENGINE" in proc.stderr
