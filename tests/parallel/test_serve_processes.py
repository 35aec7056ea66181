"""`jlco.serve` over two local processes (one CPU device each, gloo collectives, the
coordinator on 127.0.0.1): process 0 serves HTTP, process 1 runs its steps in lockstep
(`jlco.server.lockstep`). Greedy tokens — 16 requests at once, whole and streamed — equal
a one-process server's on the same weights, random and a transformers checkpoint, with
the mesh over experts and over data ranks, offload and one MTP draft on; killing process
1 mid-decode answers the request with an error, turns /health 503 and ends both
processes non-zero; SIGTERM on process 0 lets running requests finish and ends both 0."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import time

import httpx
import pytest

from tests.support.server import ROOT, ServerProcess

ONE = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
PROMPTS = [[(7 * i + 3 * j) % 250 for j in range(20 + 7 * i)] for i in range(16)]
DEPLOY = ["--offload", "--override", "engine.num_draft_tokens=1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """Two `jlco.serve` processes of one job: p0 (ready, serving) and p1 (its follower)."""

    def __init__(self, *args: str):
        addr = f"127.0.0.1:{_free_port()}"
        flags = lambda p: ["--num_processes", "2", "--process_id", str(p),   # noqa: E731
                           "--coordinator_address", addr, "--distributed_timeout_s", "300"]
        self.p1 = ServerProcess(*args, *flags(1), wait=False, env=ONE)
        try:
            self.p0 = ServerProcess(*args, *flags(0), env=ONE)
        except BaseException:
            self.p1.proc.kill()
            raise

    def stop(self) -> tuple[int, int]:
        """SIGTERM to process 0 (the drain) → both exit codes."""
        c0 = self.p0.stop()
        try:
            c1 = self.p1.proc.wait(120)
        except Exception:   # noqa: BLE001
            self.p1.proc.kill()
            c1 = self.p1.proc.wait()
        return c0, c1

    def logs(self) -> str:
        return "process 0:\n" + self.p0.stderr[-3000:] + "\nprocess 1:\n" + self.p1.stderr[-3000:]


async def _completions(url: str, prompts, n: int = 8) -> list[list[int]]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as ac:
        rs = await asyncio.gather(*(ac.post("/v1/completions", json={
            "prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}) for p in prompts))
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
    return [r.json()["choices"][0]["token_ids"] for r in rs]


def _streamed(url: str, prompt, n: int = 8) -> list[int]:
    toks = []
    with httpx.stream("POST", url + "/v1/completions", timeout=600, json={
            "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                toks += json.loads(line[6:])["choices"][0].get("token_ids") or []
    return toks


# What else crosses to process 1 with a request: a grammar (as text), penalties, a seeded
# sampler, log-prob alternatives, a prompt sharing a cached prefix.
VARIETY = [
    {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0,
     "structured_outputs": {"regex": "[a-z]{3}[0-9]{2}"}},
    {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "presence_penalty": 1.5,
     "repetition_penalty": 1.3, "logit_bias": {"21": -100}, "ignore_eos": True},
    {"prompt": PROMPTS[2], "max_tokens": 8, "temperature": 1.0, "seed": 7, "top_k": 20,
     "ignore_eos": True, "logprobs": 2},
    {"prompt": PROMPTS[15] + [9, 9], "max_tokens": 4, "temperature": 0, "ignore_eos": True},
]


def _variety(url: str, grammar: bool) -> list[tuple[list[int], list[float], str]]:
    """VARIETY's outputs (without its grammar request where no tokenizer is served)."""
    out = []
    for body in VARIETY[0 if grammar else 1:]:   # in turn: the last reuses PROMPTS[15]'s pages
        r = httpx.post(url + "/v1/completions", json={**body, "return_token_ids": True},
                       timeout=600)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        out.append((choice["token_ids"],
                    (choice.get("logprobs") or {}).get("token_logprobs") or [], choice["text"]))
    return out


def _one_process(*args: str, grammar: bool):
    srv = ServerProcess(*args, env=ONE)
    try:
        return asyncio.run(_completions(srv.url, PROMPTS)), _variety(srv.url, grammar)
    finally:
        assert srv.stop() == 0, srv.stderr[-3000:]


def _six_expert_checkpoint(tmp_path) -> list[str]:
    from tests.support.cli import make_hf_checkpoint
    make_hf_checkpoint(tmp_path / "six", n_routed_experts=6, n_group=2, topk_group=1,
                       num_experts_per_tok=3)
    return ["--checkpoint", str(tmp_path / "six")]


@pytest.mark.slow
@pytest.mark.parametrize("model,mesh", [("random", "expert=2"), ("hf_checkpoint", "data=2")])
def test_two_processes_serve_the_tokens_of_one(model, mesh, tmp_path):
    source = ["--config", str(ROOT / "configs" / "tiny.py")] + (
        [] if model == "random" else _six_expert_checkpoint(tmp_path) + [
            "--override", "engine.max_context_len=256"])    # the checkpoint's positions
    # a checkpoint saved by transformers has no MTP layer: offload alone
    deploy = DEPLOY if model == "random" else ["--offload"]
    grammar = model == "random"   # the byte-level tokenizer; the checkpoint has none
    want, want_variety = _one_process(*source, *deploy, grammar=grammar)
    job = Job(*source, *deploy, "--mesh", mesh)
    try:
        assert "distributed: process 0 of 2: 1 local of 2 devices" in job.p0.stderr
        assert ("decode step: MTP speculative, 1 draft(s)" in job.p0.stderr) == \
            (model == "random")
        got = asyncio.run(_completions(job.p0.url, PROMPTS))
        assert got == want, job.logs()
        assert _streamed(job.p0.url, PROMPTS[5]) == want[5]
        got_variety = _variety(job.p0.url, grammar)
        for (toks, logps, _), (want_toks, want_logps, _) in zip(got_variety, want_variety):
            assert toks == want_toks
            assert len(logps) == len(want_logps)
            assert all(abs(a - b) < 1e-4 for a, b in zip(logps, want_logps))
        if grammar:
            assert re.fullmatch("[a-z]{3}[0-9]{2}", got_variety[0][2]), got_variety[0]
        metrics = httpx.get(job.p0.url + "/metrics").text
        steps = {line.split('"')[1]: float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("jlco_process_steps_total{")}
        assert set(steps) == {"0", "1"} and min(steps.values()) > 0, metrics
        if model == "random":
            # SIGTERM while requests run: they finish, then both processes end cleanly
            async def drain():
                async with httpx.AsyncClient(base_url=job.p0.url, timeout=600) as ac:
                    sent = [asyncio.create_task(ac.post("/v1/completions", json={
                        "prompt": p, "max_tokens": 24, "temperature": 0,
                        "ignore_eos": True})) for p in PROMPTS[:3]]
                    await asyncio.sleep(1.0)
                    job.p0.proc.send_signal(signal.SIGTERM)
                    return await asyncio.gather(*sent)
            rs = asyncio.run(drain())
            assert [r.json()["choices"][0]["finish_reason"] for r in rs] == ["length"] * 3
    finally:
        c0, c1 = job.stop()
    assert (c0, c1) == (0, 0), job.logs()
    assert "process 1: stopped (process 0 drained the job)" in job.p1.stderr


@pytest.mark.slow
def test_killing_process_1_fails_the_job_within_the_peer_timeout():
    job = Job("--config", str(ROOT / "configs" / "tiny.py"), "--offload", "--mesh",
              "expert=2", "--peer_timeout_s", "5")
    try:
        async def killed():
            async with httpx.AsyncClient(base_url=job.p0.url, timeout=120) as ac:
                sent = asyncio.create_task(ac.post("/v1/completions", json={
                    "prompt": PROMPTS[2], "max_tokens": 400, "temperature": 0,
                    "ignore_eos": True}))
                await asyncio.sleep(2.0)
                job.p1.proc.kill()
                t0 = time.monotonic()
                r = await sent
                health = (await ac.get("/health")).status_code
                return r, time.monotonic() - t0, health
        r, waited, health = asyncio.run(killed())
        assert r.status_code >= 500 and waited < 10, (r.text, waited)
        assert health == 503
        c0 = job.p0.proc.wait(60)
    finally:
        for p in (job.p0, job.p1):
            if p.proc.poll() is None:
                p.proc.kill()
    time.sleep(0.2)
    assert c0 == 1, job.logs()
    assert job.p0.stderr.strip().splitlines()[-1].startswith(
        "jlco.serve: error: process 1 of 2 failed: no heartbeat for"), job.logs()
    assert job.p1.proc.returncode == -signal.SIGKILL


@pytest.mark.slow
def test_the_host_driven_path_is_refused_across_processes():
    """Its host pool would read rows the mesh splits across processes: both processes
    refuse it before any weight loads, naming the field and what is allowed."""
    job_args = ["--config", str(ROOT / "configs" / "tiny.py"), "--offload", "--mesh",
                "expert=2", "--override", "cache.fetch_path=host_driven"]
    addr = f"127.0.0.1:{_free_port()}"
    procs = [ServerProcess(*job_args, "--num_processes", "2", "--process_id", str(p),
                           "--coordinator_address", addr, wait=False, env=ONE)
             for p in (0, 1)]
    codes = [p.proc.wait(300) for p in procs]
    time.sleep(0.2)
    assert codes == [2, 2], [p.stderr[-2000:] for p in procs]
    for p in procs:
        assert p.stderr.strip().splitlines()[-1].startswith(
            "jlco.serve: error: cache.fetch_path='host_driven' (host-driven, storage "
            "'pinned_host') is not built for 2 processes"), p.stderr[-2000:]
