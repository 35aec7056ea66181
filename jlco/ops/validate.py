"""The offload acceptance run behind `python -m jlco.validate`: one server with the latent
cache offloaded, one baseline with it on device, the same requests to both.

Correctness  greedy completions (temperature 0, ignore_eos, return_token_ids) of
             `check_max_tokens` tokens for prompts of several lengths — by default 8
             tokens, index_topk (the first length where the sparse selection is
             exhaustive), 4 x index_topk (it really selects) and near the context limit
             (max_model_len - check_max_tokens, optionally capped) — sent one at a time
             to each server; offload on must return the baseline's token ids exactly
             (the design's promise: offload on == offload off, bit for bit). One run at
             the batch the config names on both sides: XLA may pick other kernels for
             another batch, and that would not be offload's doing.
Benefit      the same streamed load (`loadgen.LoadSpec`) against both: output tokens/s,
             TTFT, TPOT and ITL side by side with the ratio offload on / baseline. With
             servers started here, each runs it at the largest batch its banner's device
             budget allows (offload on fits more requests in the same device memory).
Stability    /metrics scraped every `scrape_every_s` while each server works, then once
             idle: process RSS, host and device pool bytes, leaked pages and running
             requests as first / last / max / least-squares slope. Fails when
             `jlco_leaked_pages` does not end at 0, or when a scrape shows
             `jlco_cache_hits_total + jlco_cache_misses_total != jlco_cache_lookups_total`
             for a layer (the collector promises one consistent snapshot per scrape).

Any mismatch, invariant failure or failed request makes the report's `ok` false (the
entry point exits 1). Servers started here run one at a time (they would share the
CPU), baseline first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import re
import sys

import numpy as np

from jlco.ops import loadgen
from jlco.ops.loadgen import LoadError, LoadSpec, ServeProcess

LENGTH = re.compile(r"^(?:(\d+)|(\d*)topk|limit)$")
STABILITY_METRICS = ("process_resident_memory_bytes", "jlco_host_pool_bytes_used",
                     "jlco_host_pool_bytes_capacity", "jlco_device_pool_bytes_used",
                     "jlco_leaked_pages", "jlco_requests_running")
OFFLOAD, BASELINE = "offload", "baseline"


@dataclasses.dataclass(frozen=True)
class ValidateSpec:
    """What to send and how to watch. `topk` None: from /v1/models (`index_topk`) when a
    length needs it."""
    load: LoadSpec
    check_lengths: tuple[str, ...] = ("8", "topk", "4topk", "limit")
    check_max_tokens: int = 16
    check_limit_cap: int = 0          # 0: the near-limit prompt is not capped
    topk: int | None = None
    scrape_every_s: float = 1.0
    server_timeout_s: float = 900.0
    request_timeout_s: float = 600.0
    api_key: str | None = None
    min_throughput_ratio: float = 0.0   # offload on / baseline output tok/s; 0: not checked
    batch_from_budget: bool = True


@dataclasses.dataclass
class Side:
    """One side: a running server (`url`) or one started here (`args_for(batch=None,
    budget_gb=None)` → `python -m jlco.serve` arguments)."""
    key: str
    label: str
    url: str | None = None
    args_for: object = None


def check_length_names(names) -> None:
    """ValueError for a --check_lengths entry that is not N, [N]topk or limit."""
    for n in names:
        m = LENGTH.match(n)
        if not m or (m.group(1) is not None and int(m.group(1)) < 1) or m.group(2) == "0":
            raise ValueError(f"--check_lengths={n!r}: allowed a token count >= 1, 'topk', "
                             "'Ntopk' (N x index_topk) or 'limit' (the context minus "
                             "--check_max_tokens)")


def resolve_lengths(spec: ValidateSpec, ctx: int, topk: int | None) -> list[dict]:
    """[{name, prompt_len}] for the server's context `ctx`."""
    room = ctx - spec.check_max_tokens
    out = []
    for name in spec.check_lengths:
        m = LENGTH.match(name)
        if m.group(1) is not None:
            n = int(m.group(1))
        elif name == "limit":
            n = min(room, spec.check_limit_cap) if spec.check_limit_cap else room
        else:
            if topk is None:
                raise LoadError("--topk is needed for --check_lengths=" + name + ": the "
                                "server's /v1/models does not say its index_topk")
            n = int(m.group(2) or 1) * topk
        if not 1 <= n <= room:
            raise LoadError(f"--check_lengths={name}: a {n}-token prompt + "
                            f"--check_max_tokens={spec.check_max_tokens} does not fit the "
                            f"server's context ({ctx} tokens)")
        out.append(dict(name=name, prompt_len=n))
    return out


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- one server session -----------------------------------------------------------------

async def session(url: str, spec: ValidateSpec, phases: tuple[str, ...], label: str,
                  lengths: list[dict] | None = None) -> dict:
    """The phases ("check", "load") against one server while /metrics is scraped, then
    an idle scrape. → {url, models, context, topk, lengths, check, load, raw, scrapes}."""
    async with loadgen.client(url, spec.load.num_clients, spec.api_key,
                              spec.request_timeout_s) as c:
        models = await loadgen.wait_ready(c, spec.server_timeout_s)
        doc = models["data"][0]
        ctx = int(doc.get("max_model_len") or 0)
        topk = spec.topk or doc.get("index_topk") or (doc.get("jlco") or {}).get("index_topk")
        out = dict(url=url, models=models, context=ctx, topk=topk)
        async with loadgen.Scraper(c, spec.scrape_every_s) as scr:
            if "check" in phases:
                out["lengths"] = lengths or resolve_lengths(spec, ctx, topk)
                out["check"] = await run_checks(c, spec, out["lengths"], label)
            if "load" in phases:
                _say(f"jlco.validate: {label}: load ({spec.load.num_requests} requests, "
                     f"{spec.load.num_clients} clients)")
                out["load"], out["raw"] = await loadgen.run_load(c, spec.load, ctx, label)
        scr.scrapes.append(await loadgen.wait_idle(c))
        out["scrapes"] = scr.scrapes
    return out


async def run_checks(c, spec: ValidateSpec, lengths: list[dict], label: str) -> list[list[int]]:
    """The greedy token ids for each length's prompt (one request at a time)."""
    _say(f"jlco.validate: {label}: correctness ({len(lengths)} greedy prompts of "
         f"{', '.join(str(x['prompt_len']) for x in lengths)} tokens)")
    out = []
    for i, x in enumerate(lengths):
        rng = np.random.default_rng([spec.load.seed, i, x["prompt_len"]])
        ids = loadgen.prompts(rng, 1, x["prompt_len"])[0]
        out.append(await loadgen.greedy_ids(c, ids, spec.check_max_tokens))
    return out


# ---- sides ------------------------------------------------------------------------------

def run_side(side: Side, spec: ValidateSpec, out_dir: pathlib.Path,
             lengths: list[dict] | None) -> list[dict]:
    """The sessions of one side: one for a URL or a server at its budget batch; two when
    a started server is restarted at its budget batch for the load."""
    if side.url is not None:
        s = asyncio.run(session(side.url, spec, ("check", "load"), side.label, lengths))
        return [dict(s, batch=None, started_here=False)]
    log = out_dir / f"server_{side.key}.log"
    srv = ServeProcess(side.label, side.args_for(), log)
    _say(f"jlco.validate: started {srv.name}, log {log}")
    sessions = []
    try:
        srv.wait_ready(spec.server_timeout_s)
        plan = srv.budget_batch() if spec.batch_from_budget else None
        restart = plan is not None and plan[0] != srv.batch
        phases = ("check",) if restart else ("check", "load")
        sessions.append(_started(srv, asyncio.run(session(srv.url, spec, phases, side.label,
                                                          lengths))))
        if restart:
            sessions[-1]["server_exit"] = srv.stop()
            _say(f"jlco.validate: restarting {srv.name} at batch {plan[0]} for the load (the "
                 f"largest in its device budget, {plan[1]} GB)")
            srv = ServeProcess(side.label, side.args_for(*plan), log, append=True)
            srv.wait_ready(spec.server_timeout_s)
            sessions.append(_started(srv, asyncio.run(session(srv.url, spec, ("load",),
                                                              side.label))))
    finally:
        code = srv.stop()
    sessions[-1]["server_exit"] = code
    return sessions


def _started(srv: ServeProcess, s: dict) -> dict:
    return dict(s, batch=srv.batch, started_here=True, server_memory=srv.memory,
                server_log=str(srv.log.name))


def validate(sides: dict[str, Side], spec: ValidateSpec, out_dir: pathlib.Path) -> dict:
    """Baseline first, then offload; → the report (see `report`)."""
    base = run_side(sides[BASELINE], spec, out_dir, None)
    first = next(s for s in base if "check" in s)
    lengths = first["lengths"]
    on = run_side(sides[OFFLOAD], spec, out_dir, lengths)
    return report(sides, spec, {BASELINE: base, OFFLOAD: on})


# ---- judging ----------------------------------------------------------------------------

def compare(lengths: list[dict], on: list[list[int]], base: list[list[int]],
            max_tokens: int) -> list[dict]:
    """Per length: equal, the first differing position and both token lists."""
    rows = []
    for x, a, b in zip(lengths, on, base):
        diff = next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), None)
        if diff is None and len(a) != len(b):
            diff = min(len(a), len(b))
        rows.append(dict(x, equal=diff is None and len(a) == max_tokens, first_diff=diff,
                         offload_ids=a, baseline_ids=b,
                         offload_token=a[diff] if diff is not None and diff < len(a) else None,
                         baseline_token=b[diff] if diff is not None and diff < len(b) else None))
    return rows


def stability(scrapes: list) -> dict:
    """First/last/max/slope of STABILITY_METRICS, and the two invariants."""
    t0 = scrapes[0].t
    metrics = {}
    for name in STABILITY_METRICS:
        pts = [(s.t - t0, s.get(name)) for s in scrapes if s.get(name) is not None]
        if pts:
            ts, ys = zip(*pts)
            metrics[name] = dict(first=ys[0], last=ys[-1], max=max(ys),
                                 slope_per_s=loadgen.slope(ts, ys), points=[list(p) for p in pts])
    broken = []
    for i, s in enumerate(scrapes):
        look, hit, miss = (s.by_label(f"jlco_cache_{k}_total", "layer")
                           for k in ("lookups", "hits", "misses"))
        for layer in sorted(set(look) | set(hit) | set(miss), key=int):
            n, h, m = look.get(layer, 0.0), hit.get(layer, 0.0), miss.get(layer, 0.0)
            if h + m != n:
                broken.append(dict(scrape=i, t_s=s.t - t0, layer=layer, lookups=n, hits=h,
                                   misses=m))
    failures = []
    leaked = metrics.get("jlco_leaked_pages", {}).get("last")
    if leaked:
        failures.append(f"jlco_leaked_pages ends at {leaked:g} (must be 0)")
    if broken:
        b = broken[0]
        failures.append(f"hits + misses != lookups in {len(broken)} layer reading(s); first: "
                        f"layer {b['layer']} at {b['t_s']:.1f} s: {b['hits']:g} + "
                        f"{b['misses']:g} != {b['lookups']:g}")
    return dict(scrapes=len(scrapes), duration_s=scrapes[-1].t - t0, metrics=metrics,
                offload_counters=any(s.has("jlco_cache_lookups_total") for s in scrapes),
                host_pool=any(s.has("jlco_host_pool_bytes_capacity") for s in scrapes),
                invariant_violations=broken[:20], failures=failures)


_BENEFIT = ("output_tokens_per_s", "requests_per_s", "ttft_s.p50", "ttft_s.p99",
            "tpot_s.p50", "tpot_s.p99", "itl_s.p50", "itl_s.p99")


def get(d: dict, key: str):
    for k in key.split("."):
        d = d.get(k) if isinstance(d, dict) else None
    return d


def report(sides: dict[str, Side], spec: ValidateSpec, sessions: dict[str, list[dict]]) -> dict:
    checks = {k: next(s for s in v if "check" in s) for k, v in sessions.items()}
    loads = {k: next(s for s in v if "load" in s) for k, v in sessions.items()}
    failures, warnings = [], []
    ctx = {k: s["context"] for k, s in checks.items()}
    if ctx[OFFLOAD] != ctx[BASELINE]:
        failures.append(f"the servers' contexts differ: offload {ctx[OFFLOAD]}, baseline "
                        f"{ctx[BASELINE]} tokens (not one deployment)")
    rows = compare(checks[BASELINE]["lengths"], checks[OFFLOAD]["check"],
                   checks[BASELINE]["check"], spec.check_max_tokens)
    for r in rows:
        if not r["equal"]:
            failures.append(f"correctness: prompt length {r['name']} ({r['prompt_len']} tokens): "
                            + _mismatch(r, spec.check_max_tokens))
    benefit = {k: {f: v for f, v in s["load"].items() if f != "requests"} | dict(batch=s["batch"])
               for k, s in loads.items()}
    for k, b in benefit.items():
        if b["errors"]:
            failures.append(f"benefit: {b['errors']} of {b['num_requests']} requests failed on "
                            f"{sides[k].label}: {b['error_messages'][0]}")
    ratio = {key: _ratio(get(benefit[OFFLOAD], key), get(benefit[BASELINE], key))
             for key in _BENEFIT}
    tput = ratio["output_tokens_per_s"]
    if spec.min_throughput_ratio and (tput is None or tput < spec.min_throughput_ratio):
        failures.append(f"benefit: throughput offload on / baseline = {tput} < "
                        f"--min_throughput_ratio={spec.min_throughput_ratio:g}")
    stab = []
    for k, ss in sessions.items():
        for s in ss:
            st = dict(side=k, label=sides[k].label, batch=s["batch"],
                      phases=[p for p in ("check", "load") if p in s], **stability(s["scrapes"]))
            failures += [f"stability ({st['label']}, batch {st['batch']}): {f}"
                         for f in st["failures"]]
            stab.append(st)
    if not any(st["offload_counters"] for st in stab if st["side"] == OFFLOAD):
        warnings.append("the offload server exports no jlco_cache_* counters: is its latent "
                        "cache offloaded (--offload)?")
    if any(st["host_pool"] for st in stab if st["side"] == BASELINE):
        warnings.append("the baseline exports a host pool: is its cache on device (--nooffload)?")
    return dict(ok=not failures, failures=failures, warnings=warnings,
                topk=checks[BASELINE]["topk"], context=ctx[BASELINE],
                correctness=dict(max_tokens=spec.check_max_tokens, ok=all(r["equal"] for r in rows),
                                 lengths=rows),
                benefit=dict(sides=benefit, ratio=ratio, load=dataclasses.asdict(spec.load)),
                stability=stab,
                servers={k: [dict(url=s["url"], batch=s["batch"], started_here=s["started_here"],
                                  memory=s.get("server_memory"), exit=s.get("server_exit"),
                                  log=s.get("server_log"), models=s["models"]) for s in v]
                         for k, v in sessions.items()})


def _mismatch(r: dict, max_tokens: int) -> str:
    a, b, i = r["offload_ids"], r["baseline_ids"], r["first_diff"]
    if i is None:
        return f"both returned {len(a)} tokens, not {max_tokens}"
    if r["offload_token"] is None or r["baseline_token"] is None:
        return f"offload on returned {len(a)} tokens, the baseline {len(b)}"
    return (f"first differing token at position {i}: offload on {r['offload_token']}, "
            f"baseline {r['baseline_token']}")


def _ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


# ---- output -----------------------------------------------------------------------------

_ROWS = (("server batch", "batch", 1, "{:.0f}"), ("requests ok", "completed", 1, "{:.0f}"),
         ("errors", "errors", 1, "{:.0f}"), ("output tok/s", "output_tokens_per_s", 1, "{:.1f}"),
         ("requests/s", "requests_per_s", 1, "{:.2f}"),
         ("TTFT p50 ms", "ttft_s.p50", 1e3, "{:.1f}"), ("TTFT p99 ms", "ttft_s.p99", 1e3, "{:.1f}"),
         ("TPOT p50 ms", "tpot_s.p50", 1e3, "{:.2f}"), ("TPOT p99 ms", "tpot_s.p99", 1e3, "{:.2f}"),
         ("ITL p99 ms", "itl_s.p99", 1e3, "{:.2f}"))
_STAB_ROWS = (("RSS MB", "process_resident_memory_bytes", 1e-6),
              ("host pool used MB", "jlco_host_pool_bytes_used", 1e-6),
              ("device pool used MB", "jlco_device_pool_bytes_used", 1e-6),
              ("leaked pages", "jlco_leaked_pages", 1), ("running", "jlco_requests_running", 1))


def _fmt(v, scale=1, fmt="{:.3g}") -> str:
    return "-" if v is None else fmt.format(v * scale)


def table(rep: dict) -> str:
    c = rep["correctness"]
    lines = [(f"correctness: greedy, {c['max_tokens']} tokens per prompt, offload on vs "
              f"baseline (index_topk {rep['topk']}, context {rep['context']})"),
             f"  {'length':<10}{'prompt':>8}  result"]
    for r in c["lengths"]:
        res = "equal" if r["equal"] else "MISMATCH: " + _mismatch(r, c["max_tokens"])
        lines.append(f"  {r['name']:<10}{r['prompt_len']:>8}  {res}")
    b, load = rep["benefit"], rep["benefit"]["load"]
    lines += [(f"benefit: {load['num_requests']} requests from {load['num_clients']} clients, "
               f"prompt {load['prompt_len']}, max_tokens {load['max_tokens']}"),
              f"  {'':<16}{'offload on':>12}{'baseline':>12}{'on/off':>9}"]
    for name, key, scale, fmt in _ROWS:
        a, z = get(b["sides"][OFFLOAD], key), get(b["sides"][BASELINE], key)
        r = _ratio(a, z)
        lines.append(f"  {name:<16}{_fmt(a, scale, fmt):>12}{_fmt(z, scale, fmt):>12}"
                     f"{_fmt(r, 1, '{:.3f}'):>9}")
    lines.append("stability: first / last / max, slope per s")
    for st in rep["stability"]:
        lines.append(f"  {st['label']}, batch {st['batch']}, {'+'.join(st['phases'])}: "
                     f"{st['scrapes']} scrapes over {st['duration_s']:.1f} s")
        for name, key, scale in _STAB_ROWS:
            m = st["metrics"].get(key)
            if m:
                lines.append(f"    {name:<20}{_fmt(m['first'], scale):>10}{_fmt(m['last'], scale):>10}"
                             f"{_fmt(m['max'], scale):>10}{_fmt(m['slope_per_s'], scale):>11}")
        lines.append(f"    hits + misses == lookups: "
                     f"{'every scrape' if not st['invariant_violations'] else 'VIOLATED'}"
                     if st["offload_counters"] else "    (no offload counters)")
    lines += [f"warning: {w}" for w in rep["warnings"]]
    lines.append("result: PASS" if rep["ok"] else "result: FAIL\n" + "\n".join(
        f"  - {f}" for f in rep["failures"]))
    return "\n".join(lines)


def plot(rep: dict, path: pathlib.Path) -> None:
    """Correctness per length, throughput and latency side by side, memory over time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    rows = rep["correctness"]["lengths"]
    n = rep["correctness"]["max_tokens"]
    same = [(r["first_diff"] if r["first_diff"] is not None else n) / n for r in rows]
    ax[0, 0].bar([f"{r['name']}\n({r['prompt_len']})" for r in rows], same,
                 color=["tab:green" if r["equal"] else "tab:red" for r in rows])
    ax[0, 0].set_ylim(0, 1.05)
    ax[0, 0].set_ylabel("leading tokens equal (fraction)")
    ax[0, 0].set_title("correctness: offload on vs baseline (greedy)")
    sides = rep["benefit"]["sides"]
    ax[0, 1].bar(["offload on", "baseline"], [sides[k]["output_tokens_per_s"] or 0
                                              for k in (OFFLOAD, BASELINE)],
                 color=["tab:blue", "tab:gray"])
    ax[0, 1].set_ylabel("output tokens/s")
    ax[0, 1].set_title("benefit: throughput (batch " + " vs ".join(
        str(sides[k]["batch"]) for k in (OFFLOAD, BASELINE)) + ")")
    keys = ("ttft_s.p50", "ttft_s.p99", "tpot_s.p50", "tpot_s.p99", "itl_s.p99")
    x = np.arange(len(keys))
    for j, (k, color) in enumerate(((OFFLOAD, "tab:blue"), (BASELINE, "tab:gray"))):
        ax[1, 0].bar(x + (j - 0.5) * 0.4, [(get(sides[k], key) or 0) * 1e3 for key in keys],
                     0.4, label=k, color=color)
    ax[1, 0].set_xticks(x, [k.replace("_s.", " ") for k in keys])
    ax[1, 0].set_ylabel("ms")
    ax[1, 0].set_title("benefit: latency")
    ax[1, 0].legend(fontsize=8)
    pool_ax = ax[1, 1].twinx()
    for i, st in enumerate(rep["stability"]):
        tag = f"{st['label']}, batch {st['batch']}"
        for key, axis, style in (("process_resident_memory_bytes", ax[1, 1], "-"),
                                 ("jlco_host_pool_bytes_used", pool_ax, "--")):
            pts = st["metrics"].get(key, {}).get("points")
            if pts:
                t, v = zip(*pts)
                axis.plot(t, np.asarray(v) / 1e6, style, color=f"C{i}", label=f"{tag}: "
                          f"{'RSS' if 'resident' in key else 'host pool'}")
    ax[1, 1].set_xlabel("s since the session's first scrape")
    ax[1, 1].set_ylabel("process RSS MB (solid)")
    pool_ax.set_ylabel("host pool used MB (dashed)")
    ax[1, 1].set_title("stability: process RSS and host pool over time")
    ax[1, 1].legend(fontsize=7, loc="upper left")
    pool_ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"jlco.validate: {'PASS' if rep['ok'] else 'FAIL'}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
