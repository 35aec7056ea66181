"""`python -m jlco.diagnose` as a user runs it: on a deliberately starved server (file
pool, one fetch thread, the minimum hot buffer) its findings name the hot-buffer
capacity; on a healthy one (a hot buffer holding the whole context) they do not; with no
traffic it says so; bad flags end in one line. The histogram quantile and the findings
are also checked on hand-made numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.cli import assert_error
from tests.support.server import ROOT, TINY_OFFLOAD, ServerProcess

STARVING = ["cache.storage=file", "cache.prefetch_threads=1",
            "cache.hot_buffer_rows=32"]     # index_topk x (1 + 0 drafts): the minimum
PROBE = ["--interval_s=1.5", "--probe_requests=8", "--probe_prompt_len=128",
         "--probe_max_tokens=24"]


def _diagnose(*args, timeout=120):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "jlco.diagnose", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env)


def _server(tmp_path_factory, overrides):
    pool = tmp_path_factory.mktemp("pool")
    args = [a for o in overrides + [f"cache.storage_path={pool}"] for a in ("--override", o)]
    return ServerProcess(*TINY_OFFLOAD, *args)


@pytest.fixture(scope="module")
def starved(tmp_path_factory):
    srv = _server(tmp_path_factory, STARVING)
    yield srv
    srv.stop()


@pytest.mark.e2e
def test_starved_server_names_the_hot_buffer(starved, tmp_path):
    proc = _diagnose(f"--url={starved.url}/v1", *PROBE, "--hardware=h200", "--json",
                     f"--out={tmp_path / 'd.json'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(proc.stdout)
    assert rep == json.loads((tmp_path / "d.json").read_text())
    m = rep["measurements"]
    assert m["offload"] and m["steps"] > 0 and m["generated_tokens"] == 8 * 24
    assert rep["probe"]["completed"] == 8
    assert m["lookups"] == m["hits"] + m["misses"] > 0 and m["active_layers"] == 3
    assert m["hit_rate"] < 0.8 and m["misses_per_layer_step"] > 10
    assert 0 < m["fetch_wait_s"] < m["step_s"] and m["fetch_share"] > 0.2   # host-driven waits
    assert m["h2d_bytes"] > 0 and m["h2d_gbps_waiting"] == pytest.approx(
        m["h2d_bytes"] / m["fetch_wait_s"] / 1e9)
    assert rep["host_link_gbps"] == 64.0 and rep["hardware"] == "H200 SXM"
    by_q = {}
    for f in rep["findings"]:
        by_q.setdefault(f["question"], []).append(f)
    (hit,) = [f for f in by_q["throughput"] if f["title"].startswith("hot-buffer hit rate")]
    assert hit["severity"] == "warn" and hit["knobs"][0] == "cache.hot_buffer_rows"
    assert "cache.hot_buffer_rows" in rep["knobs"]
    assert any(f["title"].startswith("fetch wait is") and "cache.hot_buffer_rows" in f["knobs"]
               for f in by_q["throughput"])
    assert by_q["memory"][0]["severity"] == "ok"
    assert m["gauges"]["jlco_leaked_pages"]["last"] == 0


@pytest.mark.e2e
def test_no_traffic_is_said(starved):
    proc = _diagnose(f"--url={starved.url}", "--interval_s=0.5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "INFO  [traffic] no traffic during the" in proc.stdout
    assert "--probe_requests N" in proc.stdout and "[throughput]" not in proc.stdout
    assert "(a) throughput" in proc.stdout and "(c) memory growth" in proc.stdout


@pytest.mark.slow
def test_healthy_server_does_not_blame_the_hot_buffer(tmp_path_factory):
    """The same file pool with a hot buffer as large as the context: ~all rows hit; the
    remaining wait is the host-driven path's per-layer sync, not capacity or threads."""
    srv = _server(tmp_path_factory, ["cache.storage=file", "cache.hot_buffer_rows=512"])
    try:
        proc = _diagnose(f"--url={srv.url}", *PROBE, "--json")
    finally:
        srv.stop()
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(proc.stdout)
    assert rep["measurements"]["hit_rate"] > 0.95
    assert not {"cache.hot_buffer_rows", "cache.prefetch_threads"} & set(rep["knobs"])
    assert not any(f["title"].startswith("hot-buffer hit rate") for f in rep["findings"])


def test_quantile_and_findings_on_made_up_numbers():
    from jlco.ops.diagnose import fetch_cause, hist_quantile
    b0 = [(0.01, 0.0), (0.02, 0.0), (float("inf"), 0.0)]
    b1 = [(0.01, 50.0), (0.02, 100.0), (float("inf"), 100.0)]
    assert hist_quantile(b0, b1, 0.5) == pytest.approx(0.01)
    assert hist_quantile(b0, b1, 0.99) == pytest.approx(0.0198)
    assert hist_quantile(b1, b1, 0.99) is None                       # nothing observed
    assert hist_quantile(b0, [(0.01, 1.0), (float("inf"), 3.0)], 0.99) == 0.01   # in +Inf
    base = dict(hit_rate=0.99, misses_per_layer_step=4096.0, h2d_gbps_waiting=1.0)
    assert fetch_cause(base, None)[1] == ["cache.prefetch_threads", "cache.fetch_chunk_rows"]
    assert fetch_cause(dict(base, h2d_gbps_waiting=40.0), 64.0)[1][0] == "cache.hot_buffer_rows"
    assert fetch_cause(dict(base, misses_per_layer_step=3.0), 64.0)[1] == ["cache.fetch_path"]
    assert fetch_cause(dict(base, hit_rate=0.5), 64.0)[1][0] == "cache.hot_buffer_rows"


@pytest.mark.parametrize("args, needle", [
    ([], "--url is required"),
    (["--url=localhost:1"], "--url=localhost:1: allowed"),
    (["--url=http://127.0.0.1:1", "--interval_s=0"], "--interval_s=0.0: allowed"),
    (["--url=http://127.0.0.1:1", "--probe_requests=-1"], "--probe_requests=-1: allowed"),
    (["--url=http://127.0.0.1:1", "--hardware=h9000"], "hardware='h9000' is invalid"),
    (["--url=http://127.0.0.1:1", "--nope"], "nope"),
    (["--url=http://127.0.0.1:1", "--interval_s=0.1"], "cannot reach http://127.0.0.1:1"),
])
@pytest.mark.e2e
def test_bad_input_is_one_line(args, needle):
    proc = _diagnose(*args, timeout=60)
    err = assert_error(proc, 2, "jlco.diagnose: error:", needle)
    assert len([ln for ln in err.splitlines() if "error" in ln]) == 1, err
    assert proc.stdout == ""
