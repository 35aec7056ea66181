"""tools/bench_serve.py against a real tiny server (configs/tiny.py, offload on, started
once as a user would), both scenarios, and its one-line errors for bad flags."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.support.cli import assert_error
from tests.support.server import TINY_OFFLOAD, ServerProcess

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bench(*args, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, str(ROOT / "tools" / "bench_serve.py"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(*TINY_OFFLOAD)
    yield srv
    srv.stop()


@pytest.mark.e2e
def test_load_reports_every_request(server, tmp_path):
    proc = _bench(f"--url={server.url}/v1", "--num_clients=3", "--num_requests=3",
                  "--prompt_len=20", "--max_tokens=4", f"--out={tmp_path}", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(proc.stdout)
    assert rep == json.loads((tmp_path / "bench_serve.json").read_text())
    assert (tmp_path / "bench_serve.png").stat().st_size > 0
    assert "TTFT p50 ms" in proc.stderr and "Traceback" not in proc.stderr   # table on stderr
    assert rep["scenario"] == "load" and rep["machine"]["cpu_count"] >= 1
    assert rep["flags"]["num_clients"] == 3 and "comparison" not in rep
    (run,) = rep["runs"]
    assert run["url"] == server.url and run["started_here"] is False
    assert run["models"]["data"][0]["id"] == "jlco-random-tiny"
    assert run["models"]["data"][0]["max_model_len"] == 512
    assert (run["num_requests"], run["completed"], run["errors"]) == (3, 3, 0)
    assert len(run["requests"]) == 3
    for r in run["requests"]:
        assert r["error"] is None and r["tokens"] == 4 == r["usage_tokens"]
        assert 0 < r["ttft_s"] <= r["e2e_s"] and r["tpot_s"] >= 0
        assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / 3)
    assert run["output_tokens"] == 12
    assert run["output_tokens_per_s"] == pytest.approx(12 / run["duration_s"])
    assert run["requests_per_s"] == pytest.approx(3 / run["duration_s"])
    assert run["ttft_s"]["n"] == run["tpot_s"]["n"] == 3
    assert run["itl_s"]["n"] == 3 * 3            # 3 gaps per 4-token request
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        s = run[key]
        assert 0 <= s["p50"] <= s["p99"] <= s["max"]
    assert run["server_step"]["count"] > 0 and run["server_step"]["mean_s"] > 0


@pytest.mark.e2e
def test_long_prompt_measures_both_windows(server, tmp_path):
    proc = _bench(f"--url={server.url}", "--scenario=long_prompt", "--num_clients=2",
                  "--prompt_len=20", "--long_prompt_len=200", "--long_prompts=1",
                  "--quiet_s=0.3", f"--out={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ITL p99 increase ms" in proc.stdout
    (run,) = json.loads((tmp_path / "bench_serve.json").read_text())["runs"]
    assert (tmp_path / "bench_serve.png").stat().st_size > 0
    assert run["max_tokens"] == 512 - 20 and run["long_prompt_len"] == 200
    assert run["quiet_itl_s"]["n"] > 0 and run["prefill_itl_s"]["n"] > 0
    assert run["itl_p99_increase_s"] == pytest.approx(
        run["prefill_itl_s"]["p99"] - run["quiet_itl_s"]["p99"])
    (w,) = run["windows"]
    assert w["ttft_s"] > 0 and w["steps"] >= 1        # 200 tokens: >= 4 chunks of 64
    assert run["quiet_step"]["count"] > 0 and run["prefill_step"]["count"] == w["steps"]
    assert all(0 < n < run["max_tokens"] for n in run["stream_tokens"])   # aborted early


@pytest.mark.parametrize("args, needle", [
    (["--url=http://127.0.0.1:1", "--num_clients=0"], "--num_clients=0: allowed an integer"),
    (["--url=localhost:8000"], "--url=localhost:8000: allowed http://HOST:PORT"),
    (["--url=http://127.0.0.1:1", "--request_rate=0"], "--request_rate=0.0: allowed"),
    (["--url=http://127.0.0.1:1", "--compare_offload"], "--compare_offload starts one"),
    ([], "give --url"),
    (["--config=configs/tiny.py", "--offload", "--compare_offload"], "drop --offload"),
    (["--url=http://127.0.0.1:1", "--nope"], "nope"),
    (["--url=http://127.0.0.1:1"], "cannot reach http://127.0.0.1:1"),
    (["--config=configs/tiny.py", "--override=engine.nope=1"],
     "server exited with 2: jlco.serve: error: --override='engine.nope=1'"),
])
@pytest.mark.e2e
def test_bad_input_is_one_line(args, needle, tmp_path):
    proc = _bench(*args, f"--out={tmp_path}", timeout=60)
    err = assert_error(proc, 2, "bench_serve: error:", needle)
    assert len([ln for ln in err.splitlines() if "error" in ln]) == 1, err
    assert proc.stdout == ""


@pytest.mark.slow
def test_started_server_at_its_budget_batch(tmp_path):
    """--config starts the server here; --batch_from_budget restarts it at the largest
    batch its banner plans for the device budget (tiny, offload on: 16), then SIGTERM."""
    proc = _bench("--config=configs/tiny.py", "--offload", "--batch_from_budget",
                  "--num_clients=2", "--num_requests=2", "--prompt_len=20", "--max_tokens=2",
                  f"--out={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "restarting server (offload on) at batch 16" in proc.stderr
    (run,) = json.loads((tmp_path / "bench_serve.json").read_text())["runs"]
    assert run["started_here"] and run["offload"] is True and run["server_exit"] == 0
    assert run["server_batch"] == 16 and run["completed"] == 2
    assert any("device budget 0.008 GB (--device_budget_gb)" in ln for ln in run["server_memory"])
    log = (tmp_path / "server_offload_on.log").read_text()   # both servers' stderr
    assert log.count("ready: http://") == 2 and "(batch 16," in log
    assert "0.008 GB (what offload off needs at batch 4" in log


def test_itl_split_windows_and_comparison():
    """The arithmetic without a server: a k-token chunk counts k gaps of gap/k, TPOT is
    (e2e - TTFT) / (tokens - 1), the prefill window takes the gaps ending inside it, and
    the comparison divides offload on by off."""
    spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "tools" / "bench_serve.py")
    bs = importlib.util.module_from_spec(spec)
    sys.modules["bench_serve"] = bs    # its dataclasses look their module up
    spec.loader.exec_module(bs)
    r = bs.Result(t_send=10.0, t_end=11.6, chunk_t=[10.2, 11.0, 11.5], chunk_n=[1, 2, 1],
                  done=True)
    assert r.tokens == 4 and r.ttft == pytest.approx(0.2)
    assert [t for t, _ in r.gaps()] == [11.0, 11.0, 11.5]
    assert [g for _, g in r.gaps()] == pytest.approx([0.4, 0.4, 0.5])
    s = r.summary(t0=9.0)
    assert s["send_s"] == 1.0 and s["e2e_s"] == pytest.approx(1.6)
    assert s["tpot_s"] == pytest.approx((1.6 - 0.2) / 3)
    windows = [dict(t0=10.9, t1=11.2, ttft_s=0.3, step=dict(count=2, sum_s=0.2, mean_s=0.1),
                    queue=dict(count=1, sum_s=0.0, mean_s=0.0))]
    rep, _ = bs.long_report([r], (10.0, 10.9), windows, dict(count=4, sum_s=0.2, mean_s=0.05),
                            4, 400)
    assert rep["quiet_itl_s"]["n"] == 0 and rep["prefill_itl_s"]["n"] == 2
    assert rep["prefill_itl_s"]["p99"] == pytest.approx(0.4)
    assert rep["step_increase_s"] == pytest.approx(0.05) and rep["itl_p99_increase_s"] is None
    on = dict(output_tokens_per_s=200.0, ttft_s=dict(p50=0.1))
    off = dict(output_tokens_per_s=100.0, ttft_s=dict(p50=None))
    cmp = bs.comparison([on, off], "load")
    assert cmp["output_tokens_per_s"] == dict(offload_on=200.0, offload_off=100.0, ratio=2.0)
    assert cmp["ttft_s.p50"]["ratio"] is None and cmp["itl_s.p99"]["offload_on"] is None
