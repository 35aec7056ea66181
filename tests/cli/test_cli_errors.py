"""Bad input to every entry point ends in one clear error: a non-zero exit code, no
traceback, and a message naming the culprit (flag, config field, tensor, file). Each
case is a real subprocess; cases that fail before jax loads take a fraction of a second.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest
from tests.support.cli import MPE, assert_error, make_hf_checkpoint, run

from jlco.checkpoint import safetensors_io as st

pytestmark = pytest.mark.e2e   # real subprocesses: the e2e tier (pyproject.toml)

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> pathlib.Path:
    d = tmp_path_factory.mktemp("hf") / "f32"
    make_hf_checkpoint(d)
    return d


@pytest.fixture(scope="module")
def orbax(hf, tmp_path_factory) -> pathlib.Path:
    from jlco.convert import convert
    out = tmp_path_factory.mktemp("orbax") / "o"
    convert(str(hf), str(out), dtype="float32", progress=False)
    return out


def _copy_hf(src: pathlib.Path, dst: pathlib.Path, edit) -> pathlib.Path:
    """Copy, rewriting model.safetensors through `edit(tensors)`."""
    shutil.copytree(src, dst)
    t = {n: np.array(st.read_tensor(e)) for n, e in st.read_header(dst / st.SINGLE_FILE).items()}
    edit(t)
    st.write_safetensors(dst / st.SINGLE_FILE, t)
    return dst


def _largest_state_file(d: pathlib.Path) -> pathlib.Path:
    return max((p for p in (d / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _generate(*args: str):
    return run("-m", "jlco.generate", "--max_new_tokens", "2", "--impl", "xla", *args)


# ----------------------------------------------------------------------------- generate


def test_generate_prompt_errors_fail_fast(tmp_path):
    pfile = tmp_path / "p.jsonl"
    pfile.write_text('[1, 2, 3]\n["a"]\n')
    assert_error(_generate("--prompts_file", str(pfile)), 2, f"{pfile}:2", "list of token ids")
    pfile.write_text('[1, 2]\n{"prompt": "hi"}\n')   # text needs a checkpoint's tokenizer
    assert_error(_generate("--prompts_file", str(pfile)), 2, f"{pfile}:2", "tokenizer.json")
    assert_error(_generate("--prompt_ids", "1,2", "--prompts_file", str(pfile)), 2,
                 "--prompt_ids", "--prompts_file")
    assert_error(_generate("--prompt_ids", "1,2", "--max_new_tokens", "0"), 1, "--max_new_tokens")


def test_generate_bad_config_file_values(tmp_path):
    cfg = tmp_path / "c.py"
    cfg.write_text("from jlco.config import *\nCONFIG = Config(cache=CacheConfig(offload='no'))\n")
    assert_error(_generate("--config", str(cfg), "--prompt_ids", "1,2"), 2, "cache.offload",
                 "a bool", f"{cfg}:2")
    afile = tmp_path / "afile"
    afile.write_text("x")
    cfg.write_text("from jlco.config import *\nCONFIG = Config(cache=CacheConfig("
                   f"storage='file', storage_path={str(afile)!r}))\n")
    assert_error(_generate("--config", str(cfg), "--prompt_ids", "1,2"), 2,
                 "cache.storage_path", "not a directory")


def test_generate_request_longer_than_the_model(hf):
    prompt = ",".join(["1"] * (MPE - 1))
    assert_error(_generate("--checkpoint", str(hf), "--prompt_ids", prompt), 2,
                 f"max_position_embeddings ({MPE})", f"= {MPE + 1}")


@pytest.mark.parametrize("case", ["missing_field", "wrong_type", "negative", "topk"])
def test_generate_bad_config_json(hf, tmp_path, case):
    d = tmp_path / case
    shutil.copytree(hf, d)
    cfg = json.loads((d / "config.json").read_text())
    field = {"missing_field": "kv_lora_rank", "wrong_type": "hidden_size",
             "negative": "routed_scaling_factor", "topk": "index_topk"}[case]
    if case == "missing_field":
        del cfg[field]
    else:
        cfg[field] = {"wrong_type": "64", "negative": -2.5, "topk": MPE + 1}[case]
    (d / "config.json").write_text(json.dumps(cfg))
    assert_error(_generate("--checkpoint", str(d), "--prompt_ids", "1,2"), 2, "config.json",
                 field)


def test_generate_non_finite_weight_names_tensor_and_shard(hf, tmp_path):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"

    def poison(t):
        t[name][2, 5] = np.inf
    d = _copy_hf(hf, tmp_path / "nan", poison)
    assert_error(_generate("--checkpoint", str(d), "--prompt_ids", "1,2"), 2, repr(name),
                 "(model.safetensors)", "non-finite", "[2, 5]")


def test_generate_index_escaping_the_checkpoint(hf, tmp_path):
    d = tmp_path / "sharded"
    shutil.copytree(hf, d)
    (d / st.SINGLE_FILE).rename(tmp_path / "outside.safetensors")
    names = list(st.read_header(tmp_path / "outside.safetensors"))
    weight_map = {n: "../outside.safetensors" for n in names}
    (d / st.INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    assert_error(_generate("--checkpoint", str(d), "--prompt_ids", "1,2"), 2,
                 f"entry {names[0]!r}", "'../outside.safetensors'", "outside the checkpoint")


def test_generate_corrupt_orbax_checkpoints(orbax, tmp_path):
    flipped = tmp_path / "flipped"
    shutil.copytree(orbax, flipped)
    f = _largest_state_file(flipped)
    data = bytearray(f.read_bytes())
    data[len(data) // 2: len(data) // 2 + 16] = bytes(b ^ 0xFF for b in
                                                      data[len(data) // 2: len(data) // 2 + 16])
    f.write_bytes(bytes(data))
    assert_error(_generate("--checkpoint", str(flipped), "--prompt_ids", "1,2"), 2,
                 "sha256", "leaf", "convert again")
    # Unverified, the flipped bytes are restored as they are: the run decodes (wrong
    # tokens), or, when the flip made NaN/Inf weights, fails on the non-finite output.
    ok = _generate("--checkpoint", str(flipped), "--prompt_ids", "1,2", "--noverify_checkpoint")
    assert ok.returncode in (0, 1) and "Traceback" not in ok.stderr, ok.stderr[-2000:]
    if ok.returncode == 1:
        assert "non-finite" in ok.stderr, ok.stderr[-2000:]
    truncated = tmp_path / "truncated"
    shutil.copytree(orbax, truncated)
    f = _largest_state_file(truncated)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    err = assert_error(_generate("--checkpoint", str(truncated), "--prompt_ids", "1,2"), 2,
                       "cannot be restored", str(truncated))
    assert len(err.strip().splitlines()) <= 3, err   # banner + the error, not pages
    assert_error(_generate("--checkpoint", str(orbax), "--prompt_ids", "1,2", "--dtype",
                           "bfloat16"), 2, "--dtype=bfloat16", "float32")


def test_generate_nan_output_is_not_printed_as_json(hf, tmp_path):
    """Weights saved straight to Orbax (no HF load, so no finiteness check) with a NaN
    head: --json must not print `NaN`; the run fails with exit 1 naming the token."""
    from flax import nnx

    from jlco.checkpoint.load import load_model, save_orbax
    cfg, model, _ = load_model(hf, {"dtype": "float32"}, progress=False)
    w = model.lm_head.weight
    w.set_value(w.get_value().at[:, 7].set(np.nan))
    save_orbax(tmp_path / "nan", cfg, nnx.state(model))
    r = _generate("--checkpoint", str(tmp_path / "nan"), "--prompt_ids", "1,2", "--json")
    assert_error(r, 1, "non-finite", "prompt 0")
    assert r.stdout.strip() == ""


# ----------------------------------------------------------------------------- convert


def test_convert_checks_output_first_and_reports_bad_input(hf, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    err = assert_error(run("-m", "jlco.convert", "--checkpoint", str(hf), "--output",
                           str(afile / "out")), 2, "jlco.convert: error:", "output",
                       str(afile))
    assert "loading HF tensors" not in err   # refused before reading any tensor
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    assert_error(run("-m", "jlco.convert", "--checkpoint", str(hf), "--output", str(full)), 2,
                 "not an empty directory")
    bad = tmp_path / "badjson"
    shutil.copytree(hf, bad)
    (bad / "config.json").write_text("{not json")
    assert_error(run("-m", "jlco.convert", "--checkpoint", str(bad), "--output",
                     str(tmp_path / "o")), 2, "config.json", "JSON")
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.*"))


# ----------------------------------------------------------------------------- plan, sim


def test_plan_bad_flags_and_json():
    base = ("-m", "jlco.plan", "--config", "configs/128k.py")
    out = run(*base, "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    assert isinstance(json.loads(out.stdout)["transfer"]["hides"], bool)
    assert_error(run(*base, "--hardware", "nosuch"), 2, "--hardware='nosuch'", "h200")
    assert_error(run("-m", "jlco.plan", "--config", "missing.py"), 2, "missing.py")
    assert_error(run(*base, "--context", "-5"), 1, "--context=-5")
    assert_error(run(*base, "--reserve_gb=-500"), 1, "--reserve_gb=-500")


def test_sim_bad_flags(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert_error(run("-m", "jlco.sim", "--hardware", "nosuch"), 2, "--hardware='nosuch'")
    assert_error(run("-m", "jlco.sim", "--out", str(afile / "plots")), 2, "--out",
                 "not a directory")


# ----------------------------------------------------------------------------- tools


def test_cache_study_bad_flags(tmp_path):
    tool = "tools/cache_study.py"
    assert_error(run(tool, "--synthetic", "--capacities", "abc"), 2, "--capacities=abc")
    assert_error(run(tool, "--synthetic", "--policies", "lru,random"), 2, "--policies")
    assert_error(run(tool, "--trace", str(tmp_path / "none.trace")), 2, "--trace", "none.trace")
    assert_error(run(tool, "--synthetic", "--context", "-5"), 1, "--context=-5")


def test_tune_bad_flags(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert_error(run("tools/tune.py", "--config", str(tmp_path / "missing.py")), 2,
                 "missing.py")
    assert_error(run("tools/tune.py", "--config", "configs/tiny.py", "--output",
                     str(afile / "tuned.py")), 2, "--output", "not a directory")
