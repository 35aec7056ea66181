"""A real `python -m jlco.serve` on loopback for the server tests: started as a user
would (a subprocess, port 0), ready when it prints its `ready: http://HOST:PORT/v1` line,
stopped with SIGTERM (the drain path)."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
READY = re.compile(r"ready: http://([\d.]+):(\d+)/v1")
LISTENING = re.compile(r"listening: http://([\d.]+):(\d+)")

# The tiny model with the latent cache offloaded: 4 slots, 512 positions, 64-token chunks.
TINY_OFFLOAD = ["--config", str(ROOT / "configs" / "tiny.py"), "--offload"]


class ServerProcess:
    """`python -m jlco.serve ARGS --port 0`; `url` once ready (the constructor waits for
    it unless wait=False); `stop()` → exit code."""

    def __init__(self, *args: str, timeout: float = 600.0, wait: bool = True,
                 env: dict | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jlco.serve", "--port", "0", *args], cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.url = None
        threading.Thread(target=self._read, daemon=True).start()
        if not wait:
            return
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("server did not become ready:\n" + "".join(self.lines[-60:]))

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            m = READY.search(line)
            if m:
                self.url = f"http://{m.group(1)}:{m.group(2)}"
                self._ready.set()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def port_from_log(self) -> int | None:
        """The port from the `listening:` line (printed before the model loads)."""
        m = LISTENING.search(self.stderr)
        return int(m.group(2)) if m else None

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def stop(self, timeout: float = 120.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        time.sleep(0.1)   # let the reader thread take the last lines
        return code


def server_fixtures(*args: str):
    """Module-scoped `server` (`ServerProcess(*args)`, stopped cleanly at the end) and
    `client` (the `openai` client on it) fixtures: `server, client = server_fixtures(...)`
    at a test module's top level."""
    import pytest

    @pytest.fixture(scope="module")
    def server():
        srv = ServerProcess(*args)
        yield srv
        assert srv.stop() == 0

    @pytest.fixture(scope="module")
    def client(server):
        import openai
        return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    return server, client
