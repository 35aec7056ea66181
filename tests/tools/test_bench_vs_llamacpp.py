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
