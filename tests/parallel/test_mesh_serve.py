"""The server on a 4-device CPU mesh (routed experts split over `expert`): concurrent
requests all finish, with the tokens `python -m jlco.generate` gives on one device."""

from __future__ import annotations

import asyncio
import json
import pathlib
import subprocess
import sys

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "server"))
from server_support import ServerProcess  # noqa: E402

FOUR = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
PROMPTS = [[(7 * i + 3 * j) % 250 for j in range(20 + 15 * i)] for i in range(4)]


def _one_device_tokens(prompt, n):
    r = subprocess.run([sys.executable, "-m", "jlco.generate", "--config",
                        str(ROOT / "configs" / "tiny.py"), "--offload", "--prompt_ids",
                        ",".join(map(str, prompt)), "--max_new_tokens", str(n), "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)["tokens"]


def test_server_on_an_expert_parallel_mesh():
    srv = ServerProcess("--config", str(ROOT / "configs" / "tiny.py"), "--offload",
                        "--mesh", "expert=4", env=FOUR)
    try:
        assert "mesh: {'data': 1, 'expert': 4, 'tensor': 1}" in srv.stderr

        async def crowd():
            async with httpx.AsyncClient(base_url=srv.url, timeout=300) as ac:
                rs = await asyncio.gather(*(ac.post("/v1/completions", json={
                    "prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}) for p in PROMPTS))
                return [r.json()["choices"][0]["token_ids"] for r in rs]

        got = asyncio.run(crowd())
        assert all(len(t) == 6 for t in got)
        assert got[1] == _one_device_tokens(PROMPTS[1], 6)
    finally:
        assert srv.stop() == 0, srv.stderr[-3000:]
