"""The server on a 4-device CPU mesh (routed experts split over `expert`; and with
data-parallel attention, requests spread over two data ranks): concurrent requests all
finish, with the tokens `python -m jlco.generate` gives on one device."""

from __future__ import annotations

import asyncio
import json
import pathlib
import subprocess
import sys

import httpx
import pytest

from tests.support.server import ServerProcess

ROOT = pathlib.Path(__file__).resolve().parents[2]

FOUR = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
PROMPTS = [[(7 * i + 3 * j) % 250 for j in range(20 + 15 * i)] for i in range(4)]


def _one_device_tokens(prompt, n):
    r = subprocess.run([sys.executable, "-m", "jlco.generate", "--config",
                        str(ROOT / "configs" / "tiny.py"), "--offload", "--prompt_ids",
                        ",".join(map(str, prompt)), "--max_new_tokens", str(n), "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)["tokens"]


async def _crowd(url):
    """PROMPTS sent at once, 6 greedy tokens each → (token ids per prompt, /metrics text)."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as ac:
        rs = await asyncio.gather(*(ac.post("/v1/completions", json={
            "prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}) for p in PROMPTS))
        metrics = (await ac.get("/metrics")).text
        return [r.json()["choices"][0]["token_ids"] for r in rs], metrics


@pytest.mark.slow
def test_server_on_an_expert_parallel_mesh():
    srv = ServerProcess("--config", str(ROOT / "configs" / "tiny.py"), "--offload",
                        "--mesh", "expert=4", env=FOUR)
    try:
        assert "mesh: {'data': 1, 'expert': 4, 'tensor': 1}" in srv.stderr

        got, _ = asyncio.run(_crowd(srv.url))
        assert all(len(t) == 6 for t in got)
        assert got[1] == _one_device_tokens(PROMPTS[1], 6)
    finally:
        assert srv.stop() == 0, srv.stderr[-3000:]


@pytest.mark.slow
def test_server_spreads_requests_over_data_ranks():
    """data=2 x expert=2: the 4 concurrent requests are pinned to both data ranks
    (`jlco_data_rank_requests_admitted`), and each gets its one-device tokens."""
    srv = ServerProcess("--config", str(ROOT / "configs" / "tiny.py"), "--offload",
                        "--mesh", "data=2,expert=2", env=FOUR)
    try:
        assert "mesh: {'data': 2, 'expert': 2, 'tensor': 1}" in srv.stderr

        got, metrics = asyncio.run(_crowd(srv.url))
        admitted = {line.split('"')[1]: float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("jlco_data_rank_requests_admitted_total{")}
        # 2 slots per rank and 4 requests at once: 2 on each (rank 0 also took the
        # start-up warm-up request).
        assert set(admitted) == {"0", "1"} and min(admitted.values()) >= 2, metrics
        for i in (0, 3):
            assert got[i] == _one_device_tokens(PROMPTS[i], 6)
    finally:
        assert srv.stop() == 0, srv.stderr[-3000:]


@pytest.mark.slow
def test_128k_config_serves_on_an_expert_mesh_with_mtp_offload_and_overlap():
    """The README's deployment config (offload, one MTP draft) on `--mesh expert=2` (two
    forced CPU devices, random weights): it starts, its banner names the step it runs,
    and it answers completions and chat."""
    srv = ServerProcess("--config", str(ROOT / "configs" / "128k.py"), "--mesh", "expert=2",
                        "--nowarmup", env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    try:
        assert ("decode step: MTP speculative, 1 draft(s); fetch in_jit; mesh data=1 expert=2 "
                "tensor=1; async") in srv.stderr, srv.stderr[-3000:]
        with httpx.Client(base_url=srv.url, timeout=600) as c:
            r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 6,
                                                 "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 6
            r = c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 5
    finally:
        assert srv.stop() == 0, srv.stderr[-3000:]


def _generate(ckpt, prompt, devices: int, mesh: str | None):
    env = dict(__import__("os").environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu")
    args = [sys.executable, "-m", "jlco.generate", "--checkpoint", str(ckpt), "--offload",
            "--prompt_ids", ",".join(map(str, prompt)), "--max_new_tokens", "6", "--json"]
    r = subprocess.run(args + ([] if mesh is None else ["--mesh", mesh]), cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.mark.e2e
def test_hf_checkpoint_with_six_experts_loads_sharded_and_matches_one_device(tmp_path):
    """A transformers-made checkpoint with 6 routed experts (not a power of two), loaded
    straight into its shards on an expert=2 mesh: the tokens of one device, log-probs
    within 1e-5 (the mesh reorders some f32 sums: about one ulp each)."""
    from tests.support.cli import make_hf_checkpoint
    ckpt = tmp_path / "six"
    make_hf_checkpoint(ckpt, n_routed_experts=6, n_group=2, topk_group=1,
                       num_experts_per_tok=3)
    prompt = [(11 * j + 2) % 250 for j in range(40)]
    one = _generate(ckpt, prompt, 1, None)
    two = _generate(ckpt, prompt, 2, "expert=2")
    assert two["tokens"] == one["tokens"]
    assert max(abs(a - b) for a, b in zip(two["logprobs"], one["logprobs"])) < 1e-5


@pytest.mark.slow
def test_hf_checkpoint_with_data_parallel_attention_matches_one_device(tmp_path):
    """The same 6-expert transformers checkpoint on data=2 x expert=2 (4 devices): the
    request on one data rank, its experts split over two devices, one-device tokens."""
    from tests.support.cli import make_hf_checkpoint
    ckpt = tmp_path / "six"
    make_hf_checkpoint(ckpt, n_routed_experts=6, n_group=2, topk_group=1,
                       num_experts_per_tok=3)
    prompt = [(13 * j + 5) % 250 for j in range(70)]
    one = _generate(ckpt, prompt, 1, None)
    four = _generate(ckpt, prompt, 4, "data=2,expert=2")
    assert four["tokens"] == one["tokens"]
    assert max(abs(a - b) for a, b in zip(four["logprobs"], one["logprobs"])) < 1e-5
