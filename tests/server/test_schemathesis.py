"""schemathesis against the server's own `/openapi.json` (tiny random model, offload on),
a bounded run with a fixed seed: every declared operation, its examples, coverage cases
and fuzzed bodies (valid and invalid). No 5xx, and every response conforms to what the
document declares (status codes, content types, bodies: vLLM's error shape included)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from tests.support.server import TINY_OFFLOAD, ServerProcess

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_schema_conformance")


@pytest.mark.slow
def test_the_declared_api_holds_under_fuzzing(tmp_path):
    pytest.importorskip("schemathesis", reason="the test extra installs schemathesis")
    exe = shutil.which("schemathesis") or shutil.which("st")
    srv = ServerProcess(*TINY_OFFLOAD)
    try:
        cmd = [exe] if exe else [sys.executable, "-m", "schemathesis.cli"]
        r = subprocess.run([*cmd, "run", f"{srv.url}/openapi.json", "--checks", CHECKS,
                            "--max-examples", "60", "--seed", "1", "--workers", "1",
                            "--no-shrink", "--phases", "examples,coverage,fuzzing",
                            "--report", "junit", "--report-dir", str(tmp_path)],
                           capture_output=True, text=True, timeout=1200)
    finally:
        code = srv.stop()
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, tail
    assert "unresolvable reference" not in r.stdout, tail
    assert "passed" in r.stdout and code == 0, tail
