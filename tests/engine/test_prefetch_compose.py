"""The host-driven scheduling knobs (`cache.split_attention`, `cache.prefetch_ahead`)
composed with the mesh (expert 2, data 2), MTP drafts (1, 2) and async scheduling on and
off: the engine workload's tokens equal the plainest engine's (one device, no drafts,
offload off), log-probs within tests/engine/test_composition.py's f32 bound, every page
back. Slow tier: subprocesses with 2 forced CPU devices."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.support import composition

ROOT = pathlib.Path(__file__).resolve().parents[2]
LOGPROB_ATOL = 1e-5            # as test_composition.py (a mesh orders some sums differently)
RUNS = (("expert2", 1, True, "both"), ("data2", 0, False, "both"),
        ("data2", 2, True, "prefetch"), ("one", 2, False, "split"))


@pytest.mark.slow
def test_knobs_compose_with_mesh_mtp_and_async():
    reference = composition.run(composition.REFERENCE)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "tests.support.knob_composition",
                        json.dumps(RUNS)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=1800)
    assert r.returncode == 0, r.stderr[-4000:]
    got = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(got) == len(RUNS)
    for g in got:
        where = f"{g['combo']} {g['knobs']}: {g['kind']}"
        assert g["status"] == ["finished"] * len(g["tokens"]), where
        assert g["pages_left"] == 0, where
        assert g["tokens"] == reference["tokens"], where
        for a, b in zip(g["logprobs"], reference["logprobs"]):
            assert max(abs(x - y) for x, y in zip(a, b)) < LOGPROB_ATOL, where
        assert "fetch host_driven" in g["kind"], where
