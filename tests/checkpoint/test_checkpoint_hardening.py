"""Checkpoint hardening, in process: config.json fields required and range-checked, the
compute dtype read from config.json, NaN/Inf weights refused (naming tensor and shard),
shard paths confined to the checkpoint directory, Orbax manifests with per-leaf sha256
verified on restore (flipped bytes, truncated files, old manifests), and atomic saves
that check their output first."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import ml_dtypes
import numpy as np
import pytest

from jlco.checkpoint import safetensors_io as st
from jlco.checkpoint.load import (
    MANIFEST_NAME,
    CheckpointError,
    check_new_output,
    checkpoint_dtype,
    load_hf_checkpoint,
    read_hf_config,
    restore_orbax,
    save_orbax,
)
from jlco.config import ConfigError, ModelConfig, hf_dtype, load_config

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2,
            q_lora_rank=16, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
            n_group=2, topk_group=1, index_n_heads=4, index_head_dim=16, index_topk=8,
            max_position_embeddings=128)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A tiny f32 checkpoint saved by transformers: single file and sharded."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    model = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**TINY))
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="40KB")
    assert (root / "sharded" / st.INDEX_FILE).is_file()
    return root


def _config_json(d: pathlib.Path) -> dict:
    return json.loads((d / "config.json").read_text())


def _with_config(src: pathlib.Path, dst: pathlib.Path, edit) -> pathlib.Path:
    shutil.copytree(src, dst)
    cfg = _config_json(dst)
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# ----------------------------------------------------------------------------- config.json


@pytest.mark.parametrize("field,value,pattern", [
    ("kv_lora_rank", None, r"missing required field\(s\) 'kv_lora_rank'"),
    ("index_topk", None, r"missing required field\(s\) 'index_topk'"),
    ("hidden_size", "64", r"model\.hidden_size='64' is invalid: allowed an integer"),
    ("routed_scaling_factor", -2.5, r"model\.routed_scaling_factor=-2\.5 is invalid"),
    ("index_topk", 129, r"model\.index_topk=129 .* max_position_embeddings \(128\)"),
    ("norm_topk_prob", "yes", r"model\.norm_topk_prob='yes' .* a bool"),
    ("rms_norm_eps", 0, r"model\.rms_norm_eps=0 is invalid"),
    ("rope_parameters", [1, 2], r"'rope_scaling'/'rope_parameters'=\[1, 2\]"),
    ("dtype", "float64", r"'dtype'='float64' is invalid: allowed"),
])
def test_bad_config_json_names_the_field(hf, tmp_path, field, value, pattern):
    def edit(cfg):
        if value is None:
            del cfg[field]
        else:
            cfg[field] = value
    d = _with_config(hf / "single", tmp_path / "c", edit)
    call = checkpoint_dtype if field == "dtype" else load_hf_checkpoint
    with pytest.raises(CheckpointError, match=pattern) as err:
        call(d) if field == "dtype" else call(d, progress=False)
    assert "config.json" in str(err.value)


def test_config_json_not_an_object_or_not_json(hf, tmp_path):
    d = tmp_path / "c"
    shutil.copytree(hf / "single", d)
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="must hold a JSON object"):
        read_hf_config(d)
    (d / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match=r"config\.json: cannot be read as JSON"):
        read_hf_config(d)


def test_compute_dtype_from_config_json(hf, tmp_path):
    assert checkpoint_dtype(hf / "single") == ("float32", "config.json 'dtype'")
    d = _with_config(hf / "single", tmp_path / "td", lambda c: (c.pop("dtype"), c.update(
        torch_dtype="torch.float16")))
    assert checkpoint_dtype(d) == ("float16", "config.json 'torch_dtype'")
    assert hf_dtype({}) == (None, "")
    with pytest.raises(ConfigError, match="'torch_dtype'=3"):
        hf_dtype({"torch_dtype": 3})
    from jlco.checkpoint.load import load_model
    cfg, model, _ = load_model(d, {"dtype": "float16"}, progress=False)
    assert cfg.dtype == "float16" and model.lm_head.weight[...].dtype == np.float16


# ----------------------------------------------------------------------------- weights


def test_non_finite_weight_in_a_shard_names_tensor_and_shard(hf, tmp_path):
    d = tmp_path / "s"
    shutil.copytree(hf / "sharded", d)
    name = "model.layers.0.self_attn.o_proj.weight"
    shard = json.loads((d / st.INDEX_FILE).read_text())["weight_map"][name]
    t = {n: np.array(st.read_tensor(e)) for n, e in st.read_header(d / shard).items()}
    t[name][1, 3] = np.nan
    st.write_safetensors(d / shard, t)
    with pytest.raises(CheckpointError, match=rf"'{name}' \({shard}\) has 1 non-finite "
                                              r"value\(s\) .* index \[1, 3\]"):
        load_hf_checkpoint(d, progress=False)


def test_non_finite_fp8_scale_is_caught_after_dequantisation(tmp_path):
    w, s = st.quantize_fp8_blocks(np.ones((4, 4), np.float32))
    s[0, 0] = np.inf
    e = st.TensorEntry("w", tmp_path / "x.safetensors", "F8_E4M3", (4, 4), 0, 16)
    from jlco.checkpoint.load import _check_finite
    with pytest.raises(CheckpointError, match=r"'w' \(x\.safetensors\) has 16 non-finite"):
        _check_finite("w", e, st.dequantize_fp8_blocks(w, s).astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd",
                                   "sub/../../x.safetensors", "..\\x.safetensors", 7, ""])
def test_index_shard_paths_must_stay_inside(hf, tmp_path, shard):
    d = tmp_path / "s"
    shutil.copytree(hf / "sharded", d)
    idx = json.loads((d / st.INDEX_FILE).read_text())
    idx["weight_map"]["model.norm.weight"] = shard
    (d / st.INDEX_FILE).write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=r"entry 'model\.norm\.weight'"):
        st.index_checkpoint(d)


def test_index_allows_subdirectories_and_symlinked_shards(hf, tmp_path):
    """Hub caches symlink every snapshot file into blobs/: that must keep working."""
    d = tmp_path / "snap"
    shutil.copytree(hf / "sharded", d)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    idx = json.loads((d / st.INDEX_FILE).read_text())
    first = sorted(set(idx["weight_map"].values()))[0]
    (d / first).rename(blobs / first)
    os.symlink(blobs / first, d / first)
    (d / "sub").mkdir()
    second = sorted(set(idx["weight_map"].values()))[1]
    (d / second).rename(d / "sub" / second)
    idx["weight_map"] = {n: (f"sub/{s}" if s == second else s) for n, s in idx["weight_map"].items()}
    (d / st.INDEX_FILE).write_text(json.dumps(idx))
    assert set(load_hf_checkpoint(d, progress=False).tensors) == \
        set(load_hf_checkpoint(hf / "single", progress=False).tensors)


def test_malformed_index_and_header(hf, tmp_path):
    d = tmp_path / "s"
    shutil.copytree(hf / "sharded", d)
    (d / st.INDEX_FILE).write_text("{nope")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        st.index_checkpoint(d)
    (d / st.INDEX_FILE).write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(CheckpointError, match="non-empty \"weight_map\""):
        st.index_checkpoint(d)
    f = tmp_path / "bad.safetensors"
    head = json.dumps({"x": {"dtype": "F32", "shape": [2]}}).encode()
    f.write_bytes(len(head).to_bytes(8, "little") + head + b"\0" * 8)
    with pytest.raises(CheckpointError, match=r"tensor 'x' \(bad\.safetensors\): malformed"):
        st.read_header(f)


# ----------------------------------------------------------------------------- Orbax


def _small_state(seed: int = 3):
    """(abstract state, state) of a small nnx model (bf16 and f32 leaves, nested)."""
    import jax.numpy as jnp
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(64, 32, param_dtype=jnp.bfloat16, rngs=rngs)
            self.proj = nnx.Linear(32, 48, rngs=rngs)

    return nnx.state(nnx.eval_shape(lambda: Model(nnx.Rngs(0)))), nnx.state(Model(nnx.Rngs(seed)))


def _model_cfg() -> ModelConfig:
    return load_config(ROOT / "configs" / "tiny.py").model


def _largest(d: pathlib.Path) -> pathlib.Path:
    return max((p for p in (d / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def test_manifest_records_sha256_and_restore_verifies(tmp_path):
    abstract, state = _small_state()
    out = save_orbax(tmp_path / "o", _model_cfg(), state)
    m = json.loads((out / MANIFEST_NAME).read_text())
    assert m["version"] == 2 and m["checksum"] == "sha256"
    assert all(len(v["sha256"]) == 64 for v in m["leaves"].values()) and len(m["leaves"]) == 3
    restore_orbax(out, abstract)   # intact: verifies
    bad = tmp_path / "flipped"
    shutil.copytree(out, bad)
    f = _largest(bad)
    raw = bytearray(f.read_bytes())
    i = len(raw) // 2
    raw[i:i + 8] = bytes(b ^ 0x5A for b in raw[i:i + 8])
    f.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"1 leaf fails its sha256 checksum, e\.g\. "
                                              r"'proj/kernel'") as err:
        restore_orbax(bad, _small_state()[0])
    assert str(bad) in str(err.value) and "convert again" in str(err.value)
    restore_orbax(bad, _small_state()[0], verify=False)   # what verification prevents


def test_truncated_or_missing_state_is_one_checkpoint_error(tmp_path):
    abstract, state = _small_state()
    out = save_orbax(tmp_path / "o", _model_cfg(), state)
    f = _largest(out)
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="cannot be restored") as err:
        restore_orbax(out, abstract)
    assert "See full TensorStore" not in str(err.value) and "\n" not in str(err.value)
    shutil.rmtree(out / "state")
    with pytest.raises(CheckpointError, match="has no state/ directory"):
        restore_orbax(out, _small_state()[0])
    (out / MANIFEST_NAME).write_text("{truncated")
    with pytest.raises(CheckpointError, match="cannot be read as JSON"):
        restore_orbax(out, abstract)


def test_old_manifest_without_checksums_loads_with_a_warning(tmp_path, capsys):
    abstract, state = _small_state()
    out = save_orbax(tmp_path / "o", _model_cfg(), state)
    m = json.loads((out / MANIFEST_NAME).read_text())
    m["version"] = 1
    m.pop("checksum")
    for leaf in m["leaves"].values():
        leaf.pop("sha256")
    (out / MANIFEST_NAME).write_text(json.dumps(m))
    capsys.readouterr()
    restore_orbax(out, abstract)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "warning:" in err and "no leaf checksums" in err
    restore_orbax(out, _small_state()[0], verify=False)
    assert capsys.readouterr().err == ""   # verification off: nothing to warn about


def test_save_is_atomic_and_checks_its_output(tmp_path, monkeypatch):
    import types

    import jlco.checkpoint.load as load_mod
    abstract, state = _small_state()
    cfg = _model_cfg()

    class Boom(Exception):
        pass

    def boom(*_a, **_k):
        raise Boom()
    # the manifest is written after Orbax wrote the state: fail right there
    monkeypatch.setattr(load_mod, "json", types.SimpleNamespace(dumps=boom, loads=json.loads))
    with pytest.raises(Boom):
        save_orbax(tmp_path / "o", cfg, state)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == []   # no half-written dir, no temp
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(CheckpointError, match="not an empty directory"):
        check_new_output(tmp_path / "full")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError, match="'.*afile' is not a directory"):
        check_new_output(tmp_path / "afile" / "o")
    (tmp_path / "empty").mkdir()
    save_orbax(tmp_path / "empty", cfg, state)   # an empty directory is fine
    restore_orbax(tmp_path / "empty", abstract)


def test_convert_refuses_bad_output_before_loading(hf, tmp_path, monkeypatch):
    import jlco.checkpoint.load as load_mod
    from jlco.convert import convert

    def never(*_a, **_k):
        raise AssertionError("tensors were loaded before the output was checked")
    monkeypatch.setattr(load_mod, "load_hf_checkpoint", never)
    monkeypatch.setattr(load_mod, "open_hf_checkpoint", never)   # what convert streams from
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError, match="output"):
        convert(str(hf / "single"), str(tmp_path / "afile" / "o"), progress=False)
