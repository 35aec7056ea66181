"""DeepSeek-V4 through the engine (`jlco.engine.v4_runner.V4Runner`), against
transformers' DeepseekV4ForCausalLM, f32, tiny (`jlco.checkpoint.hf_reference`: window
8, CSA rate 4 with index_topk 3, HCA rate 8; prompts longer than the window and than
index_topk entries, so CSA's selection matters).

Default tier: what Config refuses for V4 and the prefill piece plan (no compile). Slow:
the engine (continuous batching, requests arriving at different steps, a request waiting
for a slot) against transformers' greedy `generate` (tokens equal, log-probs within
1e-4), async scheduling on and off, sampling fields, prompt log-probs, the pad of a
piece and an idle slot leaving no trace, the CSA entries offloaded (bit for bit), and the
server app in-process. e2e: the `jlco.generate` CLI on the saved checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from tests.support.inprocess import serving

from jlco.config import CacheConfig, Config, ConfigError, EngineConfig, MeshConfig
from jlco.engine.v4_runner import state_len, v4_pieces
from jlco.model.deepseek_v4.config import V4Config

ENGINE = dict(max_batch_size=3, max_context_len=64, prefill_chunk=16)
# (prompt length, max_new_tokens, the engine step it arrives at)
WORKLOAD = [(37, 12, 0), (14, 6, 0), (29, 10, 3), (20, 8, 3)]


def _v4_config(**engine) -> Config:
    return Config(model=V4Config(), cache=CacheConfig(prefix_cache=False),
                  engine=EngineConfig(**engine))


# ----------------------------------------------------------------------------- default tier


@pytest.mark.parametrize("change, field", [
    (dict(cache__offload=True, cache__fetch_path="host_driven"), "cache.fetch_path"),
    (dict(cache__offload=True, cache__hot_buffer_rows=100), "cache.hot_buffer_rows"),
    (dict(cache__prefix_cache=True), "cache.prefix_cache"),
    (dict(engine__num_draft_tokens=1), "engine.num_draft_tokens"),
    (dict(mesh=MeshConfig(data=2), engine__max_batch_size=2), "mesh.data"),
    (dict(mesh=MeshConfig(expert=2), cache__offload=True), "cache.offload"),
    (dict(engine__attention_impl="pallas"), "engine.attention_impl"),
])
def test_config_refuses_what_v4_does_not_run(change, field):
    base = _v4_config()
    assert base.is_v4 and not Config().is_v4
    with pytest.raises(ConfigError, match=f"^{field}=.*deepseek_v4"):
        base.replace(**change)


def test_pieces_tile_the_prompt_in_few_widths():
    widths = set()
    for n in range(1, 100):
        pieces = v4_pieces(n, 32)
        assert [lo for lo, _, _ in pieces] == list(range(0, n, 32))
        assert pieces[-1][1] == n and all(hi - lo <= w for lo, hi, w in pieces)
        widths |= {w for _, _, w in pieces}
    assert widths == {16, 32}
    assert v4_pieces(5, 512) == [(0, 5, 16)] and v4_pieces(300, 512) == [(0, 300, 512)]
    cfg = _v4_config(max_context_len=100)
    assert state_len(cfg) == 128 >= cfg.engine.max_context_len   # a whole HCA window


def test_a_v4_checkpoint_is_chosen_and_sized_as_generate_does(tmp_path):
    """jlco.generate / jlco.serve's model choice reads a deepseek_v4 config.json as a
    V4Config (dtype from --dtype, else the checkpoint's), and the engine config built
    from it (prefix cache off) is a V4 one; the MLA loader still refuses it."""
    from transformers import DeepseekV4Config

    from jlco.checkpoint.choice import checkpoint_choice, is_v4_checkpoint
    from jlco.checkpoint.hf_reference import V4_TINY
    (tmp_path / "config.json").write_text(json.dumps(
        dict(DeepseekV4Config(**V4_TINY).to_dict(), dtype="bfloat16")))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert is_v4_checkpoint(tmp_path) and not is_v4_checkpoint(tmp_path / "none")
    choice = checkpoint_choice(str(tmp_path), None)
    assert isinstance(choice.model, V4Config) and choice.model.dtype == "bfloat16"
    assert "deepseek_v4" in choice.banner
    assert checkpoint_choice(str(tmp_path), "float32").model.dtype == "float32"
    cfg = Config().replace(model=choice.model, cache__prefix_cache=False)
    assert cfg.is_v4 and cfg.model.vocab_size == V4_TINY["vocab_size"]
    with pytest.raises(ConfigError, match="cache.prefix_cache"):
        Config().replace(model=choice.model)


# ----------------------------------------------------------------------------- slow: engine


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from jlco.checkpoint.hf_reference import build_hf_v4_model
    model = build_hf_v4_model()
    path = tmp_path_factory.mktemp("v4e") / "ckpt"
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def loaded(reference):
    from jlco.checkpoint.deepseek_v4 import load_v4
    return load_v4(reference[1], dtype="float32")


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 64, n).tolist()


def _hf_greedy(model, prompt, steps):
    import torch
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
    toks = out.sequences[0, len(prompt):].tolist()
    lps = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, toks)]
    return toks, lps


def _hf_logprobs(model, ids):
    """log_softmax of transformers' logits over `ids` [n] → [n, V]."""
    import torch
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1).numpy()


def _engine(loaded, **changes):
    from jlco.engine.core import Engine
    cfg = Config(model=loaded[0], cache=CacheConfig(prefix_cache=False),
                 engine=EngineConfig(**ENGINE)).replace(**changes)
    return Engine(cfg, loaded[1])


def _run_workload(engine, **fields):
    """WORKLOAD through `engine`: requests arriving at their steps (more than there are
    slots: the last waits for one) → the requests."""
    reqs, step = [None] * len(WORKLOAD), 0
    while step == 0 or engine.has_work or None in reqs:
        for i, (n, new, at) in enumerate(WORKLOAD):
            if at == step:
                reqs[i] = engine.submit(_prompt(n, i), new, **fields)
        engine.step()
        step += 1
    engine.check_no_leaks()
    return reqs


@pytest.fixture(scope="module")
def greedy_run(loaded):
    engine = _engine(loaded)
    seen = []
    engine.add_step_observer(lambda rec: seen.append(len(rec.running)))
    out = _run_workload(engine, top_logprobs=2)
    assert max(seen) == 3      # the slots were shared: three requests decoded together
    return engine, out


@pytest.mark.slow
def test_continuous_batch_matches_transformers_greedy(reference, greedy_run):
    """Four requests (37, 14, 29, 20 tokens) arriving at steps 0 and 3 into three slots:
    every one's tokens are transformers' greedy `generate` tokens, log-probs within 1e-4,
    and its alternatives start with the token itself."""
    engine, reqs = greedy_run
    assert engine.step_kind.follow and engine.runner.metrics is None
    for i, (r, (n, new, _)) in enumerate(zip(reqs, WORKLOAD)):
        want, want_lp = _hf_greedy(reference[0], _prompt(n, i), new)
        assert list(r.tokens) == want, i
        assert np.abs(np.asarray(r.logprobs) - want_lp).max() <= 1e-4, i
        assert [top[0][0] for top in r.top_out] == want
        assert r.finish_reason == "length"


@pytest.mark.slow
def test_async_scheduling_on_and_off_equal(loaded, greedy_run):
    _, on = greedy_run
    off_engine = _engine(loaded, engine__async_scheduling=False)
    assert not off_engine.step_kind.follow
    off = _run_workload(off_engine, top_logprobs=2)
    for a, b in zip(on, off):
        assert list(a.tokens) == list(b.tokens) and list(a.logprobs) == list(b.logprobs)


@pytest.mark.slow
def test_offloaded_csa_entries_equal_on_device_bit_for_bit(loaded, greedy_run):
    """cache.offload: the CSA layers' entries in host pools behind 3-row hot buffers
    (index_topk 3 of 16 entries), misses fetched in the step; the workload (a request
    taking a slot another left: its hot buffer emptied at install) gives the offload-off
    tokens and log-probs bit for bit, with hits and misses both counted."""
    from jlco.model.deepseek_v4.offload import OffloadEntries
    _, off = greedy_run
    engine = _engine(loaded, cache__offload=True)
    assert engine.step_kind.fetch == "in_jit"
    layers = engine.runner.state["layers"]
    stores = [st["comp"]["entries"] for st in layers
              if isinstance(st.get("comp", {}).get("entries"), OffloadEntries)]
    assert len(stores) == loaded[0].layer_types.count("compressed_sparse_attention") == 2
    assert stores[0].host.sharding.memory_kind == "pinned_host"
    assert stores[0].rows.shape[:2] == (ENGINE["max_batch_size"], 3)
    on = _run_workload(engine, top_logprobs=2)
    for a, b in zip(off, on):
        assert list(a.tokens) == list(b.tokens) and list(a.logprobs) == list(b.logprobs)
        assert a.top_out == b.top_out
    stats = engine.runner.entry_stats()
    assert stats["hits"] > 0 and stats["misses"] > 0
    assert stats["lookups"] == stats["hits"] + stats["misses"]
    _assert_counters(engine, [(n, new) for n, new, _ in WORKLOAD])
    assert sum(engine.metrics.snapshot()["per_layer"]["lookups"]) == stats["lookups"]


@pytest.mark.slow
def test_admission_warm_up_cuts_first_step_misses(loaded):
    """cache.offload with the admission warm-up (the default 32 final prefill queries'
    CSA picks in the new request's hot buffer) and without (warmup_queries=0): the same
    tokens and log-probs bit for bit, each request's one decode step (2 new tokens) looks
    up as many entries, and misses fewer of them (rows fetched at admission instead)."""
    from jlco.engine.core import Engine
    cfg = Config(model=loaded[0], cache=CacheConfig(prefix_cache=False, offload=True,
                                                    hot_buffer_rows=6),
                 engine=EngineConfig(**ENGINE))
    prompts = [_prompt(n, i) for i, (n, _, _) in enumerate(WORKLOAD)]
    runs = {}
    for warm in (0, 32):
        engine = Engine(cfg, loaded[1], warmup_queries=warm)
        reqs = engine.generate(prompts, 2)
        runs[warm] = ([(list(r.tokens), list(r.logprobs)) for r in reqs],
                      engine.metrics.snapshot()["total"], engine.runner.warmup_rows)
        engine.close()
    (cold, cold_m, cold_rows), (warm, warm_m, warm_rows) = runs[0], runs[32]
    assert warm == cold
    assert cold_rows == 0 < warm_rows
    assert warm_m["lookups"] == cold_m["lookups"] == cold_m["misses"] > 0   # cold: all miss
    assert warm_m["misses"] < cold_m["misses"], (warm_m, cold_m)


def _picks(cfg, requests) -> int:
    """CSA picks of one CSA layer over the decode steps of `requests` [(prompt length,
    new tokens)]: the query at position t sees (t + 1) // rate entries and picks up to
    index_topk of them; the first new token comes from the prefill, the last is not fed."""
    m = cfg.model
    k = min(m.index_topk, state_len(cfg) // m.compress_rate_csa)
    return sum(min(k, (t + 1) // m.compress_rate_csa)
               for n, new in requests for t in range(n, n + new - 1))


def _assert_counters(engine, requests) -> None:
    """engine.metrics (OffloadMetrics, per model layer): each CSA layer looked up exactly
    the running requests' picks, hits + misses = lookups, each miss one row host → device
    (its bytes: head_dim values); sliding and HCA layers counted nothing."""
    snap = engine.metrics.snapshot()["per_layer"]
    health = engine.metrics.health()["per_layer"]
    m = engine.cfg.model
    for layer, kind in enumerate(m.layer_types):
        want = _picks(engine.cfg, requests) if kind == "compressed_sparse_attention" else 0
        assert snap["lookups"][layer] == want, (layer, kind, snap["lookups"])
        assert snap["hits"][layer] + snap["misses"][layer] == want
        assert snap["h2d_rows"][layer] == snap["misses"][layer]
        assert snap["h2d_bytes"][layer] == snap["misses"][layer] * m.head_dim * 4
        assert health["rows_needed"][layer] == want
        assert health["rows_on_demand"][layer] == snap["misses"][layer]
        if want:
            assert 0 < snap["misses"][layer] < want, (layer, snap["misses"])


@pytest.mark.slow
def test_sampling_fields_alone_equal_batched(reference, loaded):
    """temperature / top_p / top_k / seed through the MLA engine's sampling: a sampled
    request's tokens are the same alone and in a batch, and each token's log-prob is
    transformers' over the sequence it sampled."""
    fields = dict(temperature=0.9, top_p=0.95, top_k=20, seed=11)
    prompt = _prompt(26, 9)
    alone = _engine(loaded).generate([prompt], 9, **fields)[0]
    engine = _engine(loaded)
    other = engine.submit(_prompt(33, 10), 7)
    batched = engine.submit(prompt, 9, **fields)
    engine.run()
    assert list(alone.tokens) == list(batched.tokens) and other.tokens
    lp = _hf_logprobs(reference[0], prompt + list(alone.tokens)[:-1])
    want = [lp[len(prompt) - 1 + j, t] for j, t in enumerate(alone.tokens)]
    assert np.abs(np.asarray(alone.logprobs) - want).max() <= 1e-4
    greedy = _engine(loaded).generate([prompt], 9)[0]
    assert list(greedy.tokens) != list(alone.tokens)   # the fields were not ignored


@pytest.mark.slow
def test_prompt_logprobs_match_transformers(reference, greedy_run):
    """A request echoing its prompt (prompt_logprobs=1, 37 tokens: three pieces, the last
    padded): each position's log-prob is transformers'."""
    engine, _ = greedy_run
    prompt = _prompt(37, 0)
    r = engine.generate([prompt], 1, prompt_logprobs=1)[0]
    lp = _hf_logprobs(reference[0], prompt)
    want = [lp[q - 1, prompt[q]] for q in range(1, len(prompt))]
    got = [x for x, _ in r.prompt_logprob_out]
    assert len(got) == len(want) and np.abs(np.asarray(got) - want).max() <= 1e-4


@pytest.mark.slow
def test_pad_and_idle_slots_leave_no_trace(loaded):
    """forward_chunk(valid=...): 13 real tokens padded to 16 with different junk leave
    the same state bit for bit (pos, window, entries, overlap carry; the open windows'
    buffers up to their real tokens), within f32 rounding of the unpadded piece's (a
    13-wide matmul rounds differently); a row with valid 0 keeps its state."""
    from flax import nnx

    from jlco.model.deepseek_v4 import state as v4_state
    jm = loaded[1]
    step = nnx.jit(v4_state.forward_chunk)
    toks = np.asarray([_prompt(13, 3)], np.int32)

    def run(tokens, valid=None):
        return step(jm, v4_state.init_state(jm.cfg, 1, 32), tokens, valid)[1]

    exact = run(toks)
    pads = [run(np.concatenate([toks, np.full((1, 3), j, np.int32)], axis=1),
                np.asarray([13])) for j in (7, 50)]
    assert [int(p["pos"][0]) for p in pads] == [13, 13]
    for a, b, c, kind in zip(exact["layers"], pads[0]["layers"], pads[1]["layers"],
                             jm.cfg.layer_types):
        for name, x, y, z in _parts(a, b, c, 13 % (8 if kind.startswith("heavily") else 4)):
            np.testing.assert_array_equal(y, z, err_msg=f"{kind} {name}")
            np.testing.assert_allclose(y, x, atol=1e-5, err_msg=f"{kind} {name}")
    _, idle = step(jm, pads[0], np.asarray([[5]], np.int32), np.asarray([0]))
    assert int(idle["pos"][0]) == 13
    for a, b, kind in zip(pads[0]["layers"], idle["layers"], jm.cfg.layer_types):
        for name, x, y in _parts(a, b, 13 % (8 if kind.startswith("heavily") else 4)):
            np.testing.assert_array_equal(x, y, err_msg=f"idle: {kind} {name}")


def _parts(*layers_and_real):
    """(name, leaf of each layer state) of one layer's window, entries and carries; the
    open window's buffers cut to its `real` buffered tokens (later slots are rewritten
    before a window completes)."""
    *layers, real = layers_and_real
    yield ("window", *(lay["window"] for lay in layers))
    for part in ("comp", "index"):
        for name in layers[0].get(part, {}):
            leaves = [lay[part][name] for lay in layers]
            if name.startswith("buf"):
                leaves = [x[:, :real] for x in leaves]
            yield (f"{part}.{name}", *leaves)


@pytest.mark.slow
def test_engine_refuses_what_v4_does_not_run(loaded):
    from jlco.engine.core import Engine
    cfg = Config(model=loaded[0], cache=CacheConfig(prefix_cache=False),
                 engine=EngineConfig(**ENGINE))
    with pytest.raises(ValueError, match="trace_path"):
        Engine(cfg, loaded[1], trace_path="/tmp/x")
    engine = Engine(cfg, loaded[1])
    with pytest.raises(NotImplementedError, match="deepseek_v4 prefill"):
        engine.export_prefill(_prompt(9, 0), 4)
    assert engine.prefix_stats() is None and engine.metrics is None
    assert engine.spec_metrics is None and not engine.has_work


# ----------------------------------------------------------------------------- slow: server


@pytest.mark.slow
def test_served_completions_equal_the_engine(loaded, greedy_run):
    """jlco.serve's app in-process over a V4 engine: /v1/completions with a token-id
    prompt answers the engine's greedy tokens, whole and streamed."""
    _, reqs = greedy_run
    engine = _engine(loaded)
    body = dict(model="v4", prompt=_prompt(37, 0), max_tokens=12, temperature=0,
                return_token_ids=True)
    with serving(engine.cfg, name="v4", engine=engine) as (_, client):
        whole = client.post("/v1/completions", json=body)
        assert whole.status_code == 200, whole.text
        got = whole.json()["choices"][0]["token_ids"]
        with client.stream("POST", "/v1/completions", json=dict(body, stream=True)) as s:
            lines = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    assert got == list(reqs[0].tokens)
    chunks = [json.loads(ln) for ln in lines if ln != "[DONE]"]
    streamed = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
    assert streamed == got


@pytest.mark.slow
def test_served_metrics_show_the_csa_counters(loaded):
    """jlco.serve's app in-process over an offloaded V4 engine: after a completion,
    /metrics' jlco_cache_lookups / _hits / _misses per layer are the engine's counters
    (the CSA layers' picks; the sliding and HCA layers 0)."""
    engine = _engine(loaded, cache__offload=True)
    body = dict(model="v4", prompt=_prompt(37, 0), max_tokens=12, temperature=0,
                ignore_eos=True, return_token_ids=True)
    with serving(engine.cfg, name="v4", engine=engine) as (_, client):
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        text = client.get("/metrics").text
    _assert_counters(engine, [(37, 12)])
    snap = engine.metrics.snapshot()["per_layer"]
    for name in ("lookups", "hits", "misses"):
        got = {int(ln.split('layer="')[1].split('"')[0]): float(ln.split()[-1])
               for ln in text.splitlines() if ln.startswith(f"jlco_cache_{name}_total{{")}
        assert got == {i: float(v) for i, v in enumerate(snap[name])}, (name, got)
    assert snap["lookups"][1] > 0 and snap["lookups"][0] == snap["lookups"][2] == 0
    assert "jlco_prefetch_rows_on_demand_total" in text


# ----------------------------------------------------------------------------- slow: mesh

MESH_SCRIPT = """
import json, sys, tempfile
import jax, numpy as np
from jlco.checkpoint.choice import checkpoint_choice
from jlco.checkpoint.hf_reference import build_hf_v4_model
from jlco.config import CacheConfig, Config, EngineConfig, MeshConfig
from jlco.engine.core import Engine
from jlco.launch import load
from jlco.parallel import expert as expert_parallel

calls, dispatch = [0], expert_parallel.experts_parallel

def counted(*args, **kwargs):
    calls[0] += 1
    return dispatch(*args, **kwargs)

expert_parallel.experts_parallel = counted
path = tempfile.mkdtemp()
build_hf_v4_model().save_pretrained(path)
prompts = [np.random.default_rng(i).integers(0, 64, n).tolist() for i, n in enumerate((37, 14, 29))]

def run(expert, tensor):
    choice = checkpoint_choice(path, "float32")
    cfg = Config(model=choice.model, cache=CacheConfig(prefix_cache=False),
                 engine=EngineConfig(max_batch_size=3, max_context_len=64, prefill_chunk=16),
                 mesh=MeshConfig(expert=expert, tensor=tensor))
    mesh = load.checked_mesh(cfg)
    cfg, model = load.load_sharded(choice, cfg, mesh, seed=0, verify=True)
    before = calls[0]
    with (jax.set_mesh(mesh) if mesh is not None else __import__("contextlib").nullcontext()):
        engine = Engine(cfg, model)
        reqs = engine.generate(prompts, 10, top_logprobs=2)
    return {"tokens": [list(r.tokens) for r in reqs], "logprobs": [list(r.logprobs) for r in reqs],
            "all_to_all": calls[0] - before, "kind": engine.step_kind.describe()}

print(json.dumps({"one": run(1, 1), "mesh": run(2, 2)}))
"""


@pytest.mark.slow
def test_expert_tensor_mesh_engine_equals_one_device():
    """The engine on a mesh expert=2 x tensor=2 (4 CPU devices, a subprocess: jax fixes
    its device count at start), the checkpoint loaded through jlco.launch.load as
    generate / serve load it: the one-device tokens, log-probs within 1e-5 (a mesh
    reorders some f32 sums), the routed experts through the all-to-all dispatch."""
    import os
    import pathlib
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "JAX_PLATFORMS": "cpu"}
    root = pathlib.Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", MESH_SCRIPT], cwd=root, env=env, text=True,
                       capture_output=True, timeout=900, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    one, mesh = out["one"], out["mesh"]
    assert mesh["tokens"] == one["tokens"] and mesh["all_to_all"] > 0 == one["all_to_all"]
    assert "expert=2 tensor=2" in mesh["kind"]
    for a, b in zip(one["logprobs"], mesh["logprobs"]):
        assert np.abs(np.asarray(a) - b).max() <= 1e-5


# ----------------------------------------------------------------------------- e2e: CLI


@pytest.mark.e2e
@pytest.mark.slow
def test_generate_cli_on_the_checkpoint(reference, tmp_path):
    """`python -m jlco.generate --checkpoint DIR --prompts_file F --json` on the saved
    deepseek_v4 checkpoint: transformers' greedy tokens for each prompt; with --offload
    the same results and the CSA entries' lookups counted."""
    prompts = [_prompt(37, 0), _prompt(14, 1)]
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    docs = []
    for extra in ([], ["--offload"]):
        out = subprocess.run([sys.executable, "-m", "jlco.generate", "--checkpoint",
                              str(reference[1]), "--prompts_file", str(f), "--json",
                              "--max_new_tokens", "8", "--dtype", "float32", *extra],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        assert "deepseek_v4" in out.stderr
        docs.append(json.loads(out.stdout))
    for p, r in zip(prompts, docs[0]["results"]):
        want, want_lp = _hf_greedy(reference[0], p, 8)
        assert r["tokens"] == want
        assert np.abs(np.asarray(r["logprobs"]) - want_lp).max() <= 1e-4
    assert docs[1]["results"] == docs[0]["results"] and "offload" not in docs[0]
    assert docs[1]["offload"]["csa_entries"]["lookups"] > 0
