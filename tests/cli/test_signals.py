"""SIGTERM / SIGINT during `python -m jlco.generate` with a file-backed host pool: the
process releases its resources (the pool's file is deleted), prints one line and exits
128 + signal, with no traceback."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support.cli import ROOT

pytestmark = pytest.mark.e2e   # real subprocesses: the e2e tier (pyproject.toml)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_mid_decode_cleans_up(tmp_path, sig):
    pool_dir = tmp_path / "pool"
    cfg = tmp_path / "file_pool.py"
    cfg.write_text(
        "from jlco.config import load_config\n"
        f"CONFIG = load_config({str(ROOT / 'configs' / 'tiny.py')!r}).replace(\n"
        "    cache__offload=True, cache__storage='file',\n"
        f"    cache__storage_path={str(pool_dir)!r}, engine__max_context_len=2048)\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jlco.generate", "--config", str(cfg), "--random_prompt", "64",
         "--max_new_tokens", "1900", "--impl", "xla"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "JLCO_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache")})
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:   # the pool file exists once the engine is up
            if pool_dir.is_dir() and any(pool_dir.iterdir()):
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        else:
            pytest.fail("the engine never created its file-backed pool")
        time.sleep(2.0)                      # into prefill / decode
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, (proc.returncode, err[-2000:])
    assert "Traceback" not in err, err[-3000:]
    assert f"interrupted by {signal.Signals(sig).name}" in err, err[-2000:]
    assert list(pool_dir.iterdir()) == [], "the file-backed host pool was left behind"
