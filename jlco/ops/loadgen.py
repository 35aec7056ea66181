"""Client side of the server tools: start `python -m jlco.serve` here, stream completions
over SSE and time them, and read /metrics. Shared by `tools/bench_serve.py`,
`python -m jlco.validate` and `python -m jlco.diagnose`.

Per streamed request, as the client sees it: TTFT (send -> first chunk carrying tokens),
ITL (gaps between token-bearing chunks; a chunk of k tokens counts k gaps of gap/k),
TPOT ((e2e - TTFT) / (tokens - 1)) and e2e (send -> end of stream). Prompts are random
token ids in 0..249 (valid for the byte-level random model and any real vocabulary)
with `ignore_eos`, so every request generates exactly its max_tokens.

A started server (`ServeProcess`) runs `python -m jlco.serve ARGS --port 0` from the
repository root, is ready on its `ready: http://HOST:PORT/v1` stderr line and is stopped
with SIGTERM (it drains). `start_serve(..., batch_from_budget=True)` restarts it at the
largest batch its banner's device budget allows (`memory: device budget ... largest
batch X with offload off, Y with offload on`), so offload on and off compare at one
device budget.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable

import httpx
import numpy as np

from jlco.util import cli

REPO = pathlib.Path(__file__).resolve().parents[2]
READY = re.compile(r"ready: http://(\S+?):(\d+)/v1\b")
BATCH = re.compile(r"\(batch (\d+),.* offload (on|off)")
BUDGET = re.compile(r"device budget ([\d.]+) GB .*largest batch (\d+) with offload off, "
                    r"(\d+) with offload on")
PROMPT_VOCAB = 250          # prompt ids in 0..249: valid for the byte-level demo model


class LoadError(Exception):
    """A one-line failure with its exit code (2: bad input, 1: an unusable result)."""

    def __init__(self, msg: str, code: int = cli.USAGE_EXIT):
        super().__init__(msg)
        self.code = code


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- addresses and config paths ---------------------------------------------------------

def resolve_config(path: str) -> pathlib.Path:
    """A config path as given when it exists (or is absolute), else relative to the
    repository."""
    p = pathlib.Path(path).expanduser()
    if p.is_absolute() or p.is_file():
        return p.absolute()
    alt = REPO / p
    return alt if alt.is_file() else p


def normalize_url(url: str, flag: str = "--url") -> str:
    """http(s)://HOST:PORT[/prefix] without a trailing /v1, or ValueError naming `flag`."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{flag}={url}: allowed http://HOST:PORT or https://HOST:PORT")
    path = parts.path.rstrip("/").removesuffix("/v1")
    return f"{parts.scheme}://{parts.netloc}{path}"


# ---- servers started here ---------------------------------------------------------------

def serve_args(*, config: str | None = None, checkpoint: str | None = None,
               overrides: tuple[str, ...] | list[str] = (), offload: bool | None = None,
               batch: int | None = None, budget_gb: str | float | None = None,
               api_key: str | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    """`python -m jlco.serve` arguments (without --port)."""
    args = []
    if config is not None:
        args += ["--config", str(resolve_config(config))]
    if checkpoint is not None:
        args += ["--checkpoint", str(pathlib.Path(checkpoint).expanduser().absolute())]
    for o in overrides:
        args += ["--override", o]
    if batch is not None:   # after the user's: the last override of a field wins
        args += ["--override", f"engine.max_batch_size={batch}"]
    if offload is not None:
        args.append("--offload" if offload else "--nooffload")
    if budget_gb is not None:
        args.append(f"--device_budget_gb={budget_gb}")
    if api_key:
        args.append(f"--api_key={api_key}")
    return args + list(extra)


class ServeProcess:
    """`python -m jlco.serve ARGS --port 0`, ready once it prints its ready line; stderr
    is drained by a thread into `lines` (and `log`)."""

    def __init__(self, label: str, args: list[str], log: pathlib.Path, append: bool = False):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        self.label, self.lines, self.url, self.batch, self.offload = label, [], None, None, None
        self.args = list(args)
        self.log = open(log, "a" if append else "w")  # noqa: SIM115 - closed by stop()
        self._ready = threading.Event()
        self.proc = subprocess.Popen([sys.executable, "-m", "jlco.serve", *args, "--port", "0"],
                                     cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            self.log.write(line)
            self.log.flush()
            m = READY.search(line)
            if m and not self._ready.is_set():
                host = "127.0.0.1" if m.group(1) in ("0.0.0.0", "[::]", "::") else m.group(1)
                self.url = f"http://{host}:{m.group(2)}"
                b = BATCH.search(line)
                self.batch = int(b.group(1)) if b else None
                self.offload = b.group(2) == "on" if b else None
                self._ready.set()

    def wait_ready(self, timeout: float) -> None:
        """Return once ready; otherwise (it exited, timed out, or we were interrupted)
        stop it and raise."""
        try:
            self._wait(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.2):
            exited = self.proc.poll() is not None
            if exited or time.monotonic() > deadline:
                code = self.stop()
                errs = [ln for ln in self.lines if "error:" in ln] or self.lines[-1:] or [""]
                what = f"exited with {code}" if exited else f"not ready after {timeout:g} s"
                raise LoadError(f"{self.name} {what}: {errs[-1].strip()}",
                                cli.USAGE_EXIT if code == cli.USAGE_EXIT else cli.FAILURE_EXIT)

    @property
    def name(self) -> str:
        return "server" if self.label == "server" else f"server ({self.label})"

    @property
    def memory(self) -> list[str]:
        return [ln for ln in self.lines if ln.startswith("memory:")]

    def budget_batch(self) -> tuple[int, str] | None:
        """(the largest batch the banner's device budget allows this server's offload
        setting, that budget in GB as printed)."""
        m = next((BUDGET.search(ln) for ln in self.memory if BUDGET.search(ln)), None)
        if m is None or self.offload is None:
            return None
        return int(m.group(3 if self.offload else 2)), m.group(1)

    def stop(self) -> int | None:
        """SIGTERM (the server drains), then kill after 120 s; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._reader.join(5)
        self.log.close()
        return code


def start_serve(label: str, args_for: Callable[..., list[str]], log: pathlib.Path,
                timeout: float, *, batch_from_budget: bool = False,
                prog: str = "jlco") -> ServeProcess:
    """A ready server from `args_for()`; with `batch_from_budget` restarted with
    `args_for(batch, budget_gb)` at the largest batch its banner's device budget allows
    (when that is not the batch it runs), the budget passed on explicitly (on CPU the
    default budget follows the batch). Its stderr goes to `log` (both runs')."""
    srv = ServeProcess(label, args_for(), log)
    _say(f"{prog}: started {srv.name}, log {log}")
    srv.wait_ready(timeout)
    plan = srv.budget_batch() if batch_from_budget else None
    if plan is None or plan[0] == srv.batch:
        return srv
    srv.stop()
    _say(f"{prog}: restarting {srv.name} at batch {plan[0]} (the largest in its device "
         f"budget, {plan[1]} GB)")
    srv = ServeProcess(label, args_for(*plan), log, append=True)
    srv.wait_ready(timeout)
    return srv


# ---- one streamed request ---------------------------------------------------------------

@dataclasses.dataclass
class Result:
    """One request as the client saw it (perf_counter times)."""
    t_send: float = 0.0
    t_end: float | None = None
    chunk_t: list = dataclasses.field(default_factory=list)   # token-bearing chunks
    chunk_n: list = dataclasses.field(default_factory=list)   # their token counts
    usage_tokens: int | None = None
    cached_tokens: int | None = None   # usage.prompt_tokens_details.cached_tokens
    token_ids: list = dataclasses.field(default_factory=list)
    done: bool = False
    error: str | None = None

    @property
    def tokens(self) -> int:
        return sum(self.chunk_n)

    @property
    def ttft(self) -> float | None:
        return self.chunk_t[0] - self.t_send if self.chunk_t else None

    def gaps(self) -> list[tuple[float, float]]:
        """(arrival, gap) per token after the first chunk; k tokens in a chunk: k gaps
        of gap/k."""
        out = []
        for i in range(1, len(self.chunk_t)):
            k = self.chunk_n[i]
            out += [(self.chunk_t[i], (self.chunk_t[i] - self.chunk_t[i - 1]) / k)] * k
        return out

    def summary(self, t0: float) -> dict:
        e2e = self.t_end - self.t_send if self.done else None
        tpot = (e2e - self.ttft) / (self.tokens - 1) if e2e and self.tokens > 1 else None
        return dict(send_s=self.t_send - t0, ttft_s=self.ttft, tpot_s=tpot, e2e_s=e2e,
                    tokens=self.tokens, usage_tokens=self.usage_tokens, error=self.error)


def error_text(raw: bytes) -> str:
    """The message of a vLLM-shaped error body, else the body's start."""
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw.decode(errors="replace")[:200]


async def stream_one(client: httpx.AsyncClient, body: dict, res: Result) -> Result:
    """POST one streamed completion, filling `res` as chunks arrive (so a cancelled
    stream keeps what it measured)."""
    res.t_send = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {error_text(await resp.aread())}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now, data = time.perf_counter(), line[6:]
                if data == "[DONE]":
                    res.done, res.t_end = True, now
                    break
                doc = json.loads(data)
                if "error" in doc:
                    res.error = f"stream error: {doc['error'].get('message')}"
                    break
                if doc.get("usage"):
                    res.usage_tokens = doc["usage"].get("completion_tokens")
                    details = doc["usage"].get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens")
                ids = [t for c in doc.get("choices") or () for t in c.get("token_ids") or ()]
                res.token_ids += ids
                n = len(ids)
                if n:
                    res.chunk_t.append(now)
                    res.chunk_n.append(n)
            if not res.done and res.error is None:
                res.error = "the stream ended without [DONE]"
    except (httpx.HTTPError, ValueError) as err:
        res.error = f"{type(err).__name__}: {err}"
    return res


def make_body(ids: list[int], max_tokens: int, seed: int, temperature: float = 0.0) -> dict:
    """A streamed completion of exactly `max_tokens` tokens (ignore_eos) whose chunks
    carry token ids and whose last chunk carries usage."""
    body = dict(prompt=ids, max_tokens=max_tokens, stream=True, ignore_eos=True,
                stream_options={"include_usage": True}, return_token_ids=True,
                temperature=temperature)
    if temperature > 0:
        body["seed"] = seed
    return body


async def greedy_ids(client: httpx.AsyncClient, ids: list[int], max_tokens: int) -> list[int]:
    """The token ids of one greedy, non-streamed completion (temperature 0, ignore_eos)."""
    body = dict(prompt=ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                return_token_ids=True)
    try:
        resp = await client.post("/v1/completions", json=body)
    except httpx.HTTPError as err:
        raise LoadError(f"{client.base_url}: {type(err).__name__}: {err}",
                        cli.FAILURE_EXIT) from None
    if resp.status_code != 200:
        raise LoadError(f"{client.base_url}/v1/completions answered {resp.status_code}: "
                        f"{error_text(resp.content)}", cli.FAILURE_EXIT)
    return list(resp.json()["choices"][0].get("token_ids") or [])


def prompts(rng: np.random.Generator, n: int, length: int) -> list[list[int]]:
    return [rng.integers(0, PROMPT_VOCAB, length).tolist() for _ in range(n)]


# ---- server queries ---------------------------------------------------------------------

async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    """Unlabelled samples of /metrics (histogram _sum/_count among them)."""
    resp = await client.get("/metrics")
    out = {}
    for line in resp.text.splitlines():
        parts = line.split()
        if len(parts) == 2 and not line.startswith("#") and "{" not in parts[0]:
            out[parts[0]] = float(parts[1])
    return out


def hist_delta(m0: dict, m1: dict, name: str) -> dict:
    """Count, sum and mean of histogram `name` between two scrapes."""
    n = m1.get(f"{name}_count", 0.0) - m0.get(f"{name}_count", 0.0)
    s = m1.get(f"{name}_sum", 0.0) - m0.get(f"{name}_sum", 0.0)
    return dict(count=int(n), sum_s=s, mean_s=s / n if n else None)


@dataclasses.dataclass
class Scrape:
    """One /metrics reading, parsed by prometheus_client: sample (name, sorted labels)
    → value, and when it was taken (time.monotonic, wall clock)."""
    t: float
    wall: float
    samples: dict

    @classmethod
    def parse(cls, text: str, t: float | None = None) -> Scrape:
        from prometheus_client.parser import text_string_to_metric_families
        samples = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
        return cls(time.monotonic() if t is None else t, time.time(), samples)

    def get(self, name: str, **labels) -> float | None:
        return self.samples.get((name, tuple(sorted((k, str(v)) for k, v in labels.items()))))

    def has(self, name: str) -> bool:
        return any(n == name for n, _ in self.samples)

    def total(self, name: str) -> float:
        """Sum of `name` over all its label sets (0 when absent)."""
        return sum(v for (n, _), v in self.samples.items() if n == name)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        return {dict(ls)[label]: v for (n, ls), v in self.samples.items()
                if n == name and label in dict(ls)}

    def buckets(self, name: str) -> list[tuple[float, float]]:
        """Histogram `name`'s cumulative buckets [(le, count)], sorted by le."""
        out = [(float(dict(ls)["le"]), v) for (n, ls), v in self.samples.items()
               if n == f"{name}_bucket"]
        return sorted(out)


async def scrape_full(client: httpx.AsyncClient) -> Scrape:
    """GET /metrics parsed with labels (`Scrape`)."""
    try:
        resp = await client.get("/metrics")
    except httpx.HTTPError as err:
        raise LoadError(f"cannot reach {client.base_url}/metrics: {type(err).__name__}: "
                        f"{err}", cli.FAILURE_EXIT) from None
    if resp.status_code != 200:
        raise LoadError(f"{client.base_url}/metrics answered {resp.status_code}",
                        cli.FAILURE_EXIT)
    return Scrape.parse(resp.text)


class Scraper:
    """Scrapes /metrics every `every_s` seconds in the background while its `async with`
    block runs (and once at each end); `scrapes` holds them in order."""

    def __init__(self, client: httpx.AsyncClient, every_s: float):
        self.client, self.every_s, self.scrapes = client, every_s, []
        self._task = None

    async def __aenter__(self) -> Scraper:
        self.scrapes.append(await scrape_full(self.client))
        self._task = asyncio.create_task(self._loop())
        return self

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                self.scrapes.append(await scrape_full(self.client))
            except LoadError:
                pass   # a busy server may miss a scrape; the ends are taken for sure

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        if exc[0] is None:
            self.scrapes.append(await scrape_full(self.client))


async def wait_ready(client: httpx.AsyncClient, timeout: float) -> dict:
    """Poll /health until 200 (503: still loading) → the /v1/models document."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            resp = await client.get("/health")
        except httpx.HTTPError as err:
            raise LoadError(f"cannot reach {client.base_url}: {type(err).__name__}: "
                            f"{err}") from None
        if resp.status_code == 200:
            break
        if resp.status_code != 503 or time.monotonic() > deadline:
            raise LoadError(f"{client.base_url}/health answered {resp.status_code}: "
                            f"{resp.text[:200]}")
        await asyncio.sleep(1.0)
    resp = await client.get("/v1/models")
    if resp.status_code != 200:
        raise LoadError(f"{client.base_url}/v1/models answered {resp.status_code}: "
                        f"{error_text(resp.content)}")
    return resp.json()


async def wait_idle(client: httpx.AsyncClient, timeout: float = 10.0) -> Scrape:
    """Scrape until no request runs or waits (a finished request's slot and pages come
    back at the engine's next step), at most `timeout` s → the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        s = await scrape_full(client)
        busy = (s.get("jlco_requests_running") or 0) + (s.get("jlco_requests_waiting") or 0)
        if not busy or time.monotonic() > deadline:
            return s
        await asyncio.sleep(0.05)


def client(url: str, n: int, api_key: str | None = None,
           timeout_s: float = 600.0) -> httpx.AsyncClient:
    """An async client for `n` concurrent streams (plus a few for /metrics)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(timeout_s),
                             limits=httpx.Limits(max_connections=n + 4))


def progress(total: int, desc: str):
    """tqdm on a terminal only (logs and pipes get no progress-bar noise)."""
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False,
                disable=not sys.stderr.isatty())


def machine() -> dict:
    """The client machine, for reports."""
    import platform
    d = dict(platform=platform.platform(), machine=platform.machine(),
             python=platform.python_version(), cpu_count=os.cpu_count())
    d["summary"] = f"client {d['machine']} {d['cpu_count']} cores"
    return d


# ---- statistics -------------------------------------------------------------------------

def stats(xs) -> dict:
    if not len(xs):
        return dict(n=0, mean=None, p50=None, p90=None, p99=None, max=None)
    a = np.asarray(xs, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return dict(n=int(a.size), mean=float(a.mean()), p50=float(p50), p90=float(p90),
                p99=float(p99), max=float(a.max()))


def slope(ts, ys) -> float | None:
    """Least-squares slope of ys over ts (units of y per second), None under 2 points."""
    if len(ts) < 2 or max(ts) == min(ts):
        return None
    return float(np.polyfit(np.asarray(ts, np.float64), np.asarray(ys, np.float64), 1)[0])


# ---- the load scenario ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LoadSpec:
    """`num_requests` streamed requests from `num_clients` concurrent clients; with a
    finite `request_rate` they arrive as a Poisson process (`seed`), at most
    `num_clients` in flight."""
    num_requests: int
    num_clients: int
    prompt_len: int
    max_tokens: int
    request_rate: float = float("inf")
    seed: int = 0
    temperature: float = 0.0
    warmup: bool = True


async def run_load(client: httpx.AsyncClient, spec: LoadSpec, ctx: int,
                   desc: str) -> tuple[dict, dict]:
    """The load scenario → (report, raw lists for plots: ttft, itl)."""
    n, max_tokens = spec.num_requests, spec.max_tokens
    if spec.prompt_len + max_tokens > ctx:
        raise LoadError(f"--prompt_len={spec.prompt_len} + max tokens {max_tokens} exceed "
                        f"the server's context ({ctx} tokens)")
    rng = np.random.default_rng(spec.seed)
    ps = prompts(rng, n, spec.prompt_len)
    if spec.warmup:
        warm = prompts(rng, spec.num_clients, spec.prompt_len)
        await asyncio.gather(*(stream_one(client, make_body(p, max_tokens, 0, spec.temperature),
                                          Result()) for p in warm))
    gaps = rng.exponential(1.0 / spec.request_rate, n) if math.isfinite(
        spec.request_rate) else np.zeros(n)
    arrive = np.cumsum(gaps) - gaps[0]
    sem, results = asyncio.Semaphore(spec.num_clients), [Result() for _ in range(n)]
    m0 = await scrape(client)
    bar = progress(n, desc)
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, t0 + arrive[i] - time.perf_counter()))
        async with sem:
            await stream_one(client, make_body(ps[i], max_tokens, spec.seed + i,
                                               spec.temperature), results[i])
        bar.update(1)

    await asyncio.gather(*(one(i) for i in range(n)))
    dur = time.perf_counter() - t0
    bar.close()
    m1 = await scrape(client)
    return load_report(results, t0, dur, max_tokens, hist_delta(m0, m1, "jlco_engine_step_seconds"))


def load_report(results: list[Result], t0: float, dur: float, max_tokens: int,
                server_step: dict) -> tuple[dict, dict]:
    n = len(results)
    ok = [r for r in results if r.error is None]
    reqs = [r.summary(t0) for r in results]
    itl = [g for r in ok for _, g in r.gaps()]
    ttft = [q["ttft_s"] for q in reqs if q["error"] is None]
    tpot = [q["tpot_s"] for q in reqs if q["error"] is None and q["tpot_s"] is not None]
    out_tokens = sum(r.tokens for r in results)
    rep = dict(max_tokens=max_tokens, num_requests=n, completed=len(ok),
               errors=n - len(ok),
               error_messages=sorted({r.error for r in results if r.error})[:5],
               duration_s=dur, output_tokens=out_tokens, output_tokens_per_s=out_tokens / dur,
               requests_per_s=len(ok) / dur, ttft_s=stats(ttft), tpot_s=stats(tpot),
               itl_s=stats(itl), e2e_s=stats([q["e2e_s"] for q in reqs if q["e2e_s"]]),
               server_step=server_step, requests=reqs)
    return rep, dict(ttft=ttft, itl=itl)
