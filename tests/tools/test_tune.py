"""tools/tune.py: grid, selection, token check, config writing, and one end-to-end CLI
run on a 2-layer tiny model (reference + one in-jit candidate + one unsupported)."""
import dataclasses
import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from jlco.config import Config, ConfigError, RopeScaling, load_config

ROOT = pathlib.Path(__file__).parents[2]
_spec = importlib.util.spec_from_file_location("tune", ROOT / "tools" / "tune.py")
tune = importlib.util.module_from_spec(_spec)
sys.modules["tune"] = tune   # its dataclasses look their module up
_spec.loader.exec_module(tune)

TINY = load_config(ROOT / "configs" / "tiny.py")
GRID = dict(fetch_chunk_rows=[0, 16], prefetch_threads=[2], hot_buffer_rows=[32, 64],
            eviction=["lru", "fifo"], fetch_path=["in_jit", "host_driven"],
            storage=["pinned_host"])


# engine configs (CONFIG); configs/deepseek_v4_*.py are plans for jlco.plan (DEPLOYMENT)
ENGINE_CONFIGS = [p for p in sorted((ROOT / "configs").glob("*.py"))
                  if "DEPLOYMENT = " not in p.read_text()]


@pytest.mark.parametrize("path", ENGINE_CONFIGS, ids=lambda p: p.stem)
def test_written_config_loads_back_equal(path, tmp_path):
    cfg = load_config(path)
    src = tune.render_config(cfg, "a doc")
    assert src.startswith('"""a doc') and "CONFIG = Config(" in src
    out = tmp_path / "c.py"
    tune.write_config(cfg, out)
    assert load_config(out) == cfg
    # non-default nested values survive, defaults are left out (reads like configs/*.py)
    # (a deepseek_v4 model's rope_scaling defaults to None: a YaRN one is its change)
    rope = None if type(cfg.model)().rope_scaling is not None else RopeScaling()
    changed = cfg.replace(model=dataclasses.replace(cfg.model, rope_scaling=rope),
                          cache__eviction="fifo", serve__port=9)
    tune.write_config(changed, out)
    assert load_config(out) == changed
    assert f"rope_scaling={'None' if rope is None else 'RopeScaling('}" in out.read_text()
    assert "port=9" in out.read_text()
    assert "host=" not in out.read_text()


def test_candidates_grid_order_and_validation():
    base = TINY.replace(cache__fetch_chunk_rows=16, cache__hot_buffer_rows=64,
                        cache__eviction="fifo", cache__fetch_path="in_jit")
    cands = tune.candidates(base, GRID)
    assert len(cands) == 16 and all(c.cache.offload for c in cands)
    assert tune.knobs(cands[0]) == tune.knobs(base.replace(cache__offload=True))
    assert len({tuple(tune.knobs(c).values()) for c in cands}) == 16
    assert [tune.knobs(c) for c in tune.candidates(base, GRID, seed=1)][1:] != \
        [tune.knobs(c) for c in cands][1:]   # the seed orders the rest
    with pytest.raises(ConfigError, match="cache.hot_buffer_rows"):
        tune.candidates(base, {**GRID, "hot_buffer_rows": [8]})   # < index_topk 32
    with pytest.raises(ConfigError, match="cache.eviction"):
        tune.candidates(base, {**GRID, "eviction": ["random"]})
    with pytest.raises(ValueError, match="missing knobs"):
        tune.candidates(base, {"eviction": ["lru"]})
    # Config.replace applies one section's overrides together (storage + its path)
    assert TINY.replace(cache__storage="file", cache__storage_path="/x").cache.storage == "file"
    assert tune.parse_capacity("2x", TINY) == 64 and tune.parse_capacity("48", TINY) == 48
    with pytest.raises(ValueError, match="hot_buffer_rows='big'"):
        tune.parse_capacity("big", TINY)


def _trial(tps, mean, p90, status="ok", match=True):
    return dict(status=status, throughput_tok_s=tps, tpot_ms_mean=mean, tpot_ms_p90=p90,
                tokens_match=match, knobs={"tps": tps}, message="m")


def test_pick_respects_tpot_limit_and_check_tokens():
    trials = [_trial(100, 5, 9), _trial(300, 12, 13), _trial(200, 8, 20),
              _trial(0, 0, 0, status="unsupported")]
    assert tune.pick(trials)["throughput_tok_s"] == 300
    assert tune.pick(trials, 10)["throughput_tok_s"] == 200
    assert tune.pick(trials, 10, "p90")["throughput_tok_s"] == 100
    assert tune.pick(trials, 1) is None
    with pytest.raises(ValueError, match="tpot_stat="):
        tune.pick(trials, 1, "max")
    tune.check_tokens({"trials": trials})
    with pytest.raises(tune.TokenMismatch, match="1 candidate"):
        tune.check_tokens({"trials": trials + [_trial(50, 1, 1, match=False)]})


@pytest.mark.e2e
def test_cli_end_to_end(tmp_path):
    """Real engines on a 2-layer model: the offload candidate's tokens equal the
    offload-off reference, in-jit fetch from a file pool is reported unsupported (and not
    counted as a trial), the winner is written."""
    small = TINY.replace(model=dataclasses.replace(
        TINY.model, num_hidden_layers=2, num_nextn_predict_layers=0, index_topk=16),
        engine__max_context_len=64, engine__max_batch_size=2, name="tiny2",
        cache__fetch_chunk_rows=8, cache__hot_buffer_rows=32, cache__eviction="fifo",
        cache__fetch_path="in_jit", cache__storage="file", cache__storage_path=str(tmp_path))
    # its own knobs (file + in_jit: unsupported) run first, then pinned_host
    cfg_path, out = tmp_path / "tiny2.py", tmp_path / "tuned.py"
    tune.write_config(small, cfg_path)
    cmd = [sys.executable, str(ROOT / "tools" / "tune.py"), f"--config={cfg_path}",
           f"--output={out}", "--fetch_chunk_rows=8", "--hot_buffer_rows=2x",
           "--eviction=fifo", "--fetch_path=in_jit", "--storage=file,pinned_host",
           "--num_requests=2",
           "--max_trials=1", "--repeats=2",
           "--prompt_len=24", "--gen_len=6", "--tpot_ms=60000", "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout)
    ref, (unsup, run) = report["reference"], report["trials"]   # unsupported: not a trial
    assert ref["status"] == "ok" and ref["hit_rate"] is None
    assert run["status"] == "ok" and run["tokens_match"] is True
    assert run["decode_tokens"] == 2 * 5 and run["decode_steps"] == 5  # 6 - the prefill step
    assert run["repeats_agree"] and len(run["throughput_runs"]) == 2
    assert run["throughput_tok_s"] > 0 and 0 < run["tpot_ms_mean"] <= run["tpot_ms_p90"]
    assert 0.0 <= run["hit_rate"] <= 1.0
    assert unsup["status"] == "unsupported" and "file" in unsup["message"]
    assert run["knobs"]["storage"] == "pinned_host"
    assert report["winner"]["knobs"] == run["knobs"] and report["output"] == str(out)
    want = small.replace(cache__offload=True, cache__fetch_chunk_rows=8,
                         cache__hot_buffer_rows=32, cache__eviction="fifo",
                         cache__fetch_path="in_jit", cache__storage="pinned_host",
                         name="tiny2_tuned")
    assert isinstance(load_config(out), Config) and load_config(out) == want
    assert "[2/2]" in res.stderr and "unsupported" in res.stderr   # progress lines
