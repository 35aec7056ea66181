"""Checkpoints: Hugging Face safetensors in (f32/bf16/f16/fp8 block-scaled), Orbax out.

`load_hf_checkpoint` reads a `transformers`-layout DeepSeek-V3.2 directory (one
`model.safetensors` or shards named by `model.safetensors.index.json`), checks every
tensor against the expected name → shape table and dequantises fp8 weights. A wrong
checkpoint fails here, naming the tensor and the shard, not later inside the model.

`save_orbax` / `restore_orbax` keep a converted model as an Orbax item plus
`jlco_checkpoint.json` (the ModelConfig and one shape/dtype line per leaf): Orbax enforces
shapes on restore but silently casts dtypes, so the manifest is what enforces dtypes.
`load_model` takes either kind of directory and returns a ready model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import sys
from typing import Any, Mapping

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import tqdm
from flax import nnx

from jlco.checkpoint import safetensors_io as st
from jlco.checkpoint.hf_names import hf_tensor_names, model_from_hf
from jlco.checkpoint.safetensors_io import (
    FP8_BLOCK,
    CheckpointError,
    dequantize_fp8_blocks,
)
from jlco.config import ModelConfig, RopeScaling
from jlco.model.decoder import DeepseekV32

__all__ = ["CheckpointError", "HFCheckpoint", "ignored_tensors", "load_hf_checkpoint",
           "expected_hf_tensors", "check_new_output", "save_orbax", "restore_orbax", "load_model",
           "MANIFEST_NAME", "STATE_DIR", "dequantize_fp8_blocks", "FP8_BLOCK"]

MANIFEST_NAME = "jlco_checkpoint.json"
STATE_DIR = "state"
_FORMAT_VERSION = 1
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

_SCALE_SUFFIX = "_scale_inv"
_OUT_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))


def expected_hf_tensors(cfg: ModelConfig, mtp: bool) -> dict[str, tuple[int, ...]]:
    """Expected HF tensor names → torch `[out, in]` shapes; the table is the model's own
    (jlco.checkpoint.hf_names), so loader and model cannot disagree about names."""
    if mtp and cfg.num_nextn_predict_layers != 1:
        cfg = dataclasses.replace(cfg, num_nextn_predict_layers=1)
    return {k: tuple(v) for k, v in hf_tensor_names(cfg, mtp=mtp).items()}


def ignored_tensors(cfg: ModelConfig) -> tuple[re.Pattern, ...]:
    """Tensors a checkpoint may carry that are not loaded. Explicit, so that any other
    unexpected name is an error:
    - rotary `inv_freq` buffers: recomputed from the config (transformers 5.x does not
      save them; older remote-code exports did);
    - `model.layers.{L}.embed_tokens.weight`: the released checkpoint repeats the
      embedding in its MTP layer; the MTP layer shares the main one.
    """
    return (re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),
            re.compile(re.escape(f"model.layers.{cfg.num_hidden_layers}.embed_tokens.weight")))


@dataclasses.dataclass
class HFCheckpoint:
    """A loaded, validated HF checkpoint; `tensors` are dequantised to one dtype."""
    config: ModelConfig
    tensors: dict[str, np.ndarray]
    has_mtp: bool
    path: pathlib.Path
    tokenizer_path: pathlib.Path | None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _pair_scales(entries: Mapping[str, st.TensorEntry]) -> tuple[dict, list[str]]:
    """Split entries into {name: (entry, scale_entry | None)} and problems found."""
    problems: list[str] = []
    plan: dict[str, tuple[st.TensorEntry, st.TensorEntry | None]] = {}
    for name, e in entries.items():
        if name.endswith(_SCALE_SUFFIX):
            owner = entries.get(name[: -len(_SCALE_SUFFIX)])
            if owner is None or owner.dtype != "F8_E4M3":
                problems.append(f"scale tensor {name!r} ({e.file.name}) has no fp8 (F8_E4M3) "
                                f"tensor {name[: -len(_SCALE_SUFFIX)]!r} to scale")
            continue
        scale = entries.get(name + _SCALE_SUFFIX)
        if e.dtype == "F8_E4M3" and scale is None:
            problems.append(f"fp8 tensor {name!r} ({e.file.name}) has no scale tensor "
                            f"{name + _SCALE_SUFFIX!r}")
        plan[name] = (e, scale)
    return plan, problems


def _check_entry(name: str, e: st.TensorEntry, scale: st.TensorEntry | None,
                 want: tuple[int, ...]) -> list[str]:
    where = f"tensor {name!r} ({e.file.name})"
    if e.dtype not in st.SUPPORTED_DTYPES:
        return [f"{where} has unsupported dtype {e.dtype}: allowed "
                + ", ".join(st.SUPPORTED_DTYPES)]
    if e.shape != want:
        return [f"{where} has shape {list(e.shape)}, expected {list(want)}"]
    if e.dtype != "F8_E4M3" or scale is None:  # _pair_scales reports unpaired ones
        return []
    if len(e.shape) != 2:
        return [f"{where} is fp8 but not 2-D (shape {list(e.shape)}); block scales need [out, in]"]
    want_s = tuple(-(-n // FP8_BLOCK) for n in e.shape)
    if scale.dtype not in ("F32", "BF16"):
        return [f"scale tensor {scale.name!r} ({scale.file.name}) has dtype {scale.dtype}: "
                "allowed F32, BF16"]
    if scale.shape != want_s:
        return [f"scale tensor {scale.name!r} ({scale.file.name}) has shape {list(scale.shape)},"
                f" expected {list(want_s)} (ceil of {list(e.shape)} / {FP8_BLOCK})"]
    return []


def _validate(plan: Mapping, expected: Mapping[str, tuple[int, ...]],
              ignored: tuple[re.Pattern, ...]) -> list[str]:
    problems = [f"missing tensor {n!r} (shape {list(s)})" for n, s in expected.items()
                if n not in plan]
    for name, (e, scale) in plan.items():
        if name not in expected:
            if not any(p.fullmatch(name) for p in ignored):
                problems.append(f"unknown tensor {name!r} ({e.file.name}), "
                                f"shape {list(e.shape)}, dtype {e.dtype}")
            continue
        problems += _check_entry(name, e, scale, expected[name])
    return problems


def _raise_if(problems: list[str], path: pathlib.Path) -> None:
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise CheckpointError(f"checkpoint {str(path)!r}: {len(problems)} problem(s):\n  "
                              f"{shown}{more}")


def _out_dtype(dtype: Any) -> np.dtype:
    dt = np.dtype(dtype)
    if dt not in _OUT_DTYPES:
        raise CheckpointError(f"dtype={dt} is invalid: allowed np.float32, ml_dtypes.bfloat16")
    return dt


def read_hf_config(path: str | os.PathLike, **overrides: Any) -> ModelConfig:
    path = pathlib.Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{str(path)!r} has no config.json (not an HF checkpoint dir)")
    return ModelConfig.from_hf_dict(json.loads(cfg_file.read_text()), **overrides)


def load_hf_checkpoint(path: str | os.PathLike, *, dtype: Any = np.float32,
                       progress: bool = True, cfg_overrides: Mapping[str, Any] | None = None
                       ) -> HFCheckpoint:
    """Read, validate and dequantise a HF DeepSeek-V3.2 checkpoint directory.

    Validation runs on the headers before any tensor data is read, so a bad 600 GB
    checkpoint fails in seconds. MTP tensors (`model.layers.{num_hidden_layers}.*`) are
    detected by name; when present they are validated and loaded too, and the returned
    config's num_nextn_predict_layers says whether they were (1) or not (0).
    """
    path = pathlib.Path(path)
    out_dt = _out_dtype(dtype)
    cfg = read_hf_config(path, **dict(cfg_overrides or {}))
    entries = st.index_checkpoint(path)
    mtp_prefix = f"model.layers.{cfg.num_hidden_layers}."
    has_mtp = any(n.startswith(mtp_prefix) for n in entries)
    # The MTP layer exists in the model iff its tensors exist: transformers' saves carry
    # num_nextn_predict_layers=1 in config.json (or omit it) but drop model.layers.{L}.*.
    cfg = dataclasses.replace(cfg, num_nextn_predict_layers=int(has_mtp))
    expected = expected_hf_tensors(cfg, has_mtp)
    plan, problems = _pair_scales(entries)
    problems += _validate(plan, expected, ignored_tensors(cfg))
    _raise_if(problems, path)
    tensors: dict[str, np.ndarray] = {}
    names = [n for n in plan if n in expected]
    bar = tqdm.tqdm(names, desc="loading HF tensors", unit="tensor", file=sys.stderr,
                    disable=not progress)
    for name in bar:
        e, scale = plan[name]
        bar.set_postfix_str(e.file.name, refresh=False)
        raw = st.read_tensor(e)
        if e.dtype == "F8_E4M3":
            arr = dequantize_fp8_blocks(raw, st.read_tensor(scale)).astype(out_dt, copy=False)
        else:
            arr = raw.astype(out_dt)  # astype copies: the memory map is not kept alive
        tensors[name] = arr
    tok = path / "tokenizer.json"
    return HFCheckpoint(config=cfg, tensors=tensors, has_mtp=has_mtp, path=path,
                        tokenizer_path=tok if tok.is_file() else None)


# ----------------------------------------------------------------------------- Orbax


def _config_to_json(cfg: ModelConfig) -> dict:
    return dataclasses.asdict(cfg)


def _config_from_json(d: Mapping[str, Any], where: str) -> ModelConfig:
    d = dict(d)
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise CheckpointError(f"{where}: unknown model config field(s) {unknown}")
    rs = d.get("rope_scaling")
    d["rope_scaling"] = RopeScaling(**rs) if rs is not None else None
    return ModelConfig(**d)


def _leaf_key(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _leaf_table(tree: Any) -> dict[str, dict]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {_leaf_key(p): {"shape": list(x.shape), "dtype": str(np.dtype(x.dtype))}
            for p, x in flat}


def _pure(state: Any) -> Any:
    return nnx.to_pure_dict(state) if isinstance(state, nnx.State) else state


def check_new_output(path: str | os.PathLike) -> pathlib.Path:
    """Absolute `path`, refused if it already holds a checkpoint (checked before a long
    conversion, and again by save_orbax)."""
    path = pathlib.Path(path).absolute()
    if (path / STATE_DIR).exists() or (path / MANIFEST_NAME).exists():
        raise CheckpointError(f"output {str(path)!r} already holds a checkpoint; "
                              "choose a new directory")
    return path


def save_orbax(path: str | os.PathLike, cfg: ModelConfig, state: Any,
               tokenizer_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Write `state` (nnx.State or its pure dict) as an Orbax item + config/manifest JSON.

    The path must not hold a checkpoint already: overwriting a model in place would leave
    a half-written mix if interrupted. The manifest is written last, so a directory
    without it (an interrupted save) is never taken for a checkpoint.
    """
    path = check_new_output(path)
    path.mkdir(parents=True, exist_ok=True)
    pure = _pure(state)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path / STATE_DIR, pure)
    ckptr.wait_until_finished()
    manifest = {"format": "jlco-orbax", "version": _FORMAT_VERSION,
                "model_config": _config_to_json(cfg), "leaves": _leaf_table(pure)}
    if tokenizer_dir is not None:
        for fname in _TOKENIZER_FILES:
            src = pathlib.Path(tokenizer_dir) / fname
            if src.is_file():
                (path / fname).write_bytes(src.read_bytes())
    (path / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1))
    return path


def read_manifest(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, dict]]:
    mfile = pathlib.Path(path) / MANIFEST_NAME
    if not mfile.is_file():
        raise CheckpointError(f"{str(path)!r} has no {MANIFEST_NAME} (not a jlco Orbax dir)")
    m = json.loads(mfile.read_text())
    if m.get("format") != "jlco-orbax" or m.get("version") != _FORMAT_VERSION:
        raise CheckpointError(f"{mfile}: format {m.get('format')!r} version {m.get('version')!r}"
                              f" is invalid: allowed 'jlco-orbax' version {_FORMAT_VERSION}")
    return _config_from_json(m["model_config"], str(mfile)), m["leaves"]


def _check_manifest(saved: Mapping[str, dict], want: Mapping[str, dict], where: str) -> None:
    problems = [f"leaf {k!r} missing from the checkpoint" for k in want if k not in saved]
    problems += [f"leaf {k!r} in the checkpoint is not in the model" for k in saved
                 if k not in want]
    problems += [f"leaf {k!r}: checkpoint {saved[k]['dtype']}{saved[k]['shape']}, model "
                 f"{w['dtype']}{w['shape']}" for k, w in want.items()
                 if k in saved and saved[k] != w]
    _raise_if(problems, pathlib.Path(where))


def abstract_model(cfg: ModelConfig):
    """(graphdef, abstract nnx.State) of the model, without allocating weights."""
    return nnx.split(nnx.eval_shape(lambda: DeepseekV32(cfg, rngs=nnx.Rngs(0))))


def restore_orbax(path: str | os.PathLike, abstract_state: Any = None) -> tuple[ModelConfig, Any]:
    """Restore (cfg, state). `abstract_state` defaults to the model's (nnx.eval_shape);
    every leaf's shape and dtype must match what was saved."""
    path = pathlib.Path(path).absolute()
    cfg, leaves = read_manifest(path)
    if abstract_state is None:
        abstract_state = abstract_model(cfg)[1]
    target = _pure(abstract_state)
    _check_manifest(leaves, _leaf_table(target), str(path))
    restored = ocp.StandardCheckpointer().restore(path / STATE_DIR, target)
    if isinstance(abstract_state, nnx.State):
        nnx.replace_by_pure_dict(abstract_state, restored)
        return cfg, abstract_state
    return cfg, restored


# ----------------------------------------------------------------------------- any dir


def checkpoint_kind(path: str | os.PathLike) -> str:
    """'orbax' (jlco manifest present) or 'hf' (config.json + safetensors)."""
    p = pathlib.Path(path)
    if (p / MANIFEST_NAME).is_file():
        return "orbax"
    if (p / "config.json").is_file() and ((p / st.SINGLE_FILE).is_file()
                                          or (p / st.INDEX_FILE).is_file()):
        return "hf"
    raise CheckpointError(f"checkpoint path {str(p)!r} is neither a jlco Orbax dir "
                          f"({MANIFEST_NAME}) nor a HF dir (config.json + {st.SINGLE_FILE} "
                          f"or {st.INDEX_FILE})")


def load_model(path: str | os.PathLike, cfg_overrides: Mapping[str, Any] | None = None,
               *, progress: bool = True):
    """Return (ModelConfig, DeepseekV32, info) from a HF or jlco Orbax directory.

    For HF, `cfg_overrides` apply on top of config.json (e.g. dtype='float32'); for Orbax,
    they must not change any weight's shape or dtype (the manifest check says which).
    """
    overrides = dict(cfg_overrides or {})
    kind = checkpoint_kind(path)
    if kind == "hf":
        cfg = read_hf_config(path, **overrides)
        dt = np.float32 if cfg.dtype == "float32" else ml_dtypes.bfloat16
        ck = load_hf_checkpoint(path, dtype=dt, progress=progress, cfg_overrides=overrides)
        model = model_from_hf(ck.config, ck.tensors, mtp=ck.has_mtp)
        info = {"kind": kind, "path": str(ck.path), "has_mtp": ck.has_mtp,
                "tokenizer_path": ck.tokenizer_path, "tensors": len(ck.tensors),
                "bytes": ck.nbytes}
        return ck.config, model, info
    saved_cfg, _ = read_manifest(path)
    cfg = dataclasses.replace(saved_cfg, **overrides)
    graphdef, abstract = abstract_model(cfg)
    _, state = restore_orbax(path, abstract)
    model = nnx.merge(graphdef, state)
    tok = pathlib.Path(path) / "tokenizer.json"
    info = {"kind": kind, "path": str(pathlib.Path(path).absolute()),
            "has_mtp": cfg.num_nextn_predict_layers > 0,
            "tokenizer_path": tok if tok.is_file() else None}
    return cfg, model, info
