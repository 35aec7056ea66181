"""Checkpoints: Hugging Face safetensors in (f32/bf16/f16/fp8 block-scaled), Orbax out.

`open_hf_checkpoint` validates a `transformers`-layout DeepSeek-V3.2 directory (one
`model.safetensors` or shards named by `model.safetensors.index.json`) from its headers:
every tensor against the expected name → shape table. `load_model` then streams each
device's slice of each weight from the memory-mapped files (`jlco.checkpoint.stream`,
fp8 dequantised per slice); `load_hf_checkpoint` instead reads every tensor whole into
host memory (tests and tools that compare tensors). A wrong checkpoint fails here or
while streaming, naming the tensor and the shard, not later inside the model: a
config.json field missing or out of range, a shape, a dtype, a NaN/Inf weight.

`save_orbax` / `restore_orbax` keep a converted model as an Orbax item plus
`jlco_checkpoint.json` (the ModelConfig and one shape/dtype/sha256 line per leaf): Orbax
enforces shapes on restore but silently casts dtypes and restores flipped bytes, so the
manifest is what enforces dtypes and integrity. Any restore failure is one
CheckpointError. `load_model` takes either kind of directory and returns a ready model.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
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
from jlco.checkpoint.hf_names import hf_tensor_names
from jlco.checkpoint.safetensors_io import (
    FP8_BLOCK,
    CheckpointError,
    dequantize_fp8_blocks,
)
from jlco.checkpoint.stream import HFIndex, Shardings, build_model, sharding_for
from jlco.checkpoint.stream import check_finite as _check_finite
from jlco.config import ConfigError, ModelConfig, RopeScaling, hf_dtype
from jlco.model.decoder import DeepseekV32
from jlco.util import atomic

__all__ = ["CheckpointError", "HFCheckpoint", "HFIndex", "ignored_tensors", "load_hf_checkpoint",
           "open_hf_checkpoint",
           "expected_hf_tensors", "check_new_output", "save_orbax", "restore_orbax", "load_model",
           "read_hf_config", "checkpoint_dtype", "load_dtype",
           "MANIFEST_NAME", "STATE_DIR", "SAVE_INFLIGHT_BYTES", "dequantize_fp8_blocks",
           "FP8_BLOCK"]

MANIFEST_NAME = "jlco_checkpoint.json"
STATE_DIR = "state"
_FORMAT_VERSION = 2          # 2: the manifest records a sha256 per leaf
_READ_VERSIONS = (1, 2)
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


def _hf_config_dict(path: pathlib.Path) -> tuple[pathlib.Path, dict]:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{str(path)!r} has no config.json (not an HF checkpoint dir)")
    try:
        return cfg_file, json.loads(cfg_file.read_text())
    except (ValueError, OSError) as err:
        raise CheckpointError(f"{cfg_file}: cannot be read as JSON ({err})") from None


def read_hf_config(path: str | os.PathLike, **overrides: Any) -> ModelConfig:
    """The ModelConfig of a HF checkpoint's config.json; a missing, mistyped or
    out-of-range field is a CheckpointError naming config.json and the field."""
    cfg_file, d = _hf_config_dict(pathlib.Path(path))
    try:
        return ModelConfig.from_hf_dict(d, **overrides)
    except ConfigError as err:
        raise CheckpointError(f"{cfg_file}: {err}") from None
    except TypeError as err:   # e.g. an unknown key inside rope_scaling
        raise CheckpointError(f"{cfg_file}: {err}") from None


def checkpoint_dtype(path: str | os.PathLike) -> tuple[str | None, str]:
    """(dtype, where it was read) of a HF or jlco Orbax checkpoint, without its weights:
    HF: config.json's `dtype` (transformers 5) or `torch_dtype`, (None, ...) when it
    names none; Orbax: the dtype its weights were converted to (its manifest)."""
    path = pathlib.Path(path)
    if checkpoint_kind(path) == "orbax":
        return read_manifest(path)[0].dtype, f"the Orbax manifest {MANIFEST_NAME}"
    cfg_file, d = _hf_config_dict(path)
    try:
        dtype, key = hf_dtype(d)
    except ConfigError as err:
        raise CheckpointError(f"{cfg_file}: {err}") from None
    return dtype, (f"config.json {key!r}" if dtype else "config.json names no dtype")


def load_dtype(model_dtype: str) -> np.dtype:
    """The dtype HF tensors are read into for a model computing in `model_dtype`: f32 and
    bf16 directly; float16 via f32 (each weight is cast to the model dtype once, so bf16/fp8
    sources are not rounded twice)."""
    return np.dtype(ml_dtypes.bfloat16) if model_dtype == "bfloat16" else np.dtype(np.float32)


def open_hf_checkpoint(path: str | os.PathLike, *,
                       cfg_overrides: Mapping[str, Any] | None = None) -> HFIndex:
    """Validate a HF DeepSeek-V3.2 checkpoint directory from its headers alone, before
    any tensor data is read, so a bad 600 GB checkpoint fails in seconds. MTP tensors
    (`model.layers.{num_hidden_layers}.*`) are detected by name; when present they are
    validated and loaded too, and the config's num_nextn_predict_layers says whether
    they were (1) or not (0)."""
    path = pathlib.Path(path)
    _hf_config_dict(path)              # is it a checkpoint at all (config.json, weights)?
    entries = st.index_checkpoint(path)
    cfg = read_hf_config(path, **dict(cfg_overrides or {}))
    mtp_prefix = f"model.layers.{cfg.num_hidden_layers}."
    has_mtp = any(n.startswith(mtp_prefix) for n in entries)
    # The MTP layer exists in the model iff its tensors exist: transformers' saves carry
    # num_nextn_predict_layers=1 in config.json (or omit it) but drop model.layers.{L}.*.
    cfg = dataclasses.replace(cfg, num_nextn_predict_layers=int(has_mtp))
    expected = expected_hf_tensors(cfg, has_mtp)
    plan, problems = _pair_scales(entries)
    problems += _validate(plan, expected, ignored_tensors(cfg))
    _raise_if(problems, path)
    tok = path / "tokenizer.json"
    return HFIndex(config=cfg, plan={n: plan[n] for n in plan if n in expected},
                   has_mtp=has_mtp, path=path, tokenizer_path=tok if tok.is_file() else None)


def load_hf_checkpoint(path: str | os.PathLike, *, dtype: Any = np.float32,
                       progress: bool = True, cfg_overrides: Mapping[str, Any] | None = None
                       ) -> HFCheckpoint:
    """Read, validate and dequantise every tensor of a HF checkpoint into host memory
    (`open_hf_checkpoint` validates; tests and tools comparing tensors use this). Loading
    a model goes through `load_model`, which streams instead (jlco.checkpoint.stream)."""
    out_dt = _out_dtype(dtype)
    index = open_hf_checkpoint(path, cfg_overrides=cfg_overrides)
    tensors: dict[str, np.ndarray] = {}
    bar = tqdm.tqdm(index.plan, desc="loading HF tensors", unit="tensor", file=sys.stderr,
                    disable=not (progress and sys.stderr.isatty()))   # no bars in logs
    for name in bar:
        e, scale = index.plan[name]
        bar.set_postfix_str(e.file.name, refresh=False)
        raw = st.read_tensor(e)
        if e.dtype == "F8_E4M3":
            arr = dequantize_fp8_blocks(raw, st.read_tensor(scale)).astype(out_dt, copy=False)
        else:
            arr = raw.astype(out_dt)  # astype copies: the memory map is not kept alive
        _check_finite(name, e, arr)
        tensors[name] = arr
    return HFCheckpoint(config=index.config, tensors=tensors, has_mtp=index.has_mtp,
                        path=index.path, tokenizer_path=index.tokenizer_path)


# ----------------------------------------------------------------------------- Orbax


def _config_to_json(cfg: ModelConfig) -> dict:
    return dataclasses.asdict(cfg)


def _config_from_json(d: Mapping[str, Any], where: str) -> ModelConfig:
    if not isinstance(d, Mapping):
        raise CheckpointError(f"{where}: model_config must be a JSON object")
    d = dict(d)
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise CheckpointError(f"{where}: unknown model config field(s) {unknown}")
    try:
        rs = d.get("rope_scaling")
        d["rope_scaling"] = RopeScaling(**rs) if rs is not None else None
        return ModelConfig(**d)
    except (ConfigError, TypeError) as err:
        raise CheckpointError(f"{where}: model_config: {err}") from None


def _leaf_key(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _leaves(tree: Any) -> dict[str, Any]:
    return {_leaf_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _leaf_table(tree: Any) -> dict[str, dict]:
    return {k: {"shape": list(x.shape), "dtype": str(np.dtype(x.dtype))}
            for k, x in _leaves(tree).items()}


def _digest(x: Any) -> str:
    """sha256 of a leaf's bytes (C order, native little-endian)."""
    a = np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)
    return hashlib.sha256(a).hexdigest()


def _digests(tree: Any) -> dict[str, str]:
    """sha256 per leaf, hashed on threads (hashlib releases the GIL on large buffers).
    A leaf split over other processes' devices (a multi-host mesh) is first gathered
    whole, one leaf at a time in this thread: a collective every process runs in the
    same leaf order (it moves every such leaf to every host: per-shard digests written
    at conversion would scale better)."""
    leaves = _leaves(tree)
    spread = {k: x for k, x in leaves.items()
              if isinstance(x, jax.Array) and not x.is_fully_addressable}
    out = {}
    if spread:
        from jax.experimental import multihost_utils
        for k, x in spread.items():
            out[k] = _digest(multihost_utils.process_allgather(x, tiled=True))
    local = {k: x for k, x in leaves.items() if k not in spread}
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        out.update(zip(local, pool.map(_digest, local.values())))
    return {k: out[k] for k in leaves}


def _pure(state: Any) -> Any:
    return nnx.to_pure_dict(state) if isinstance(state, nnx.State) else state


def check_new_output(path: str | os.PathLike) -> pathlib.Path:
    """Absolute `path` if a checkpoint can be written there: it must not exist or be an
    empty directory, and be creatable by us. Checked before a long conversion, and again
    by save_orbax."""
    path = pathlib.Path(path).absolute()
    if (path / STATE_DIR).exists() or (path / MANIFEST_NAME).exists():
        raise CheckpointError(f"output {str(path)!r} already holds a checkpoint; "
                              "choose a new directory")
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise CheckpointError(f"output {str(path)!r} exists and is not an empty directory; "
                              "choose a new directory")
    try:
        return atomic.check_writable(path, "output")
    except OSError as err:
        raise CheckpointError(str(err)) from None


SAVE_INFLIGHT_BYTES = 1 << 30   # default cap on bytes Orbax copies to host / writes at once


def _inflight_bytes(pure: Any, cap: int | None) -> int:
    """Orbax's in-flight limit must admit the largest single shard of any leaf."""
    biggest = max((max((s.data.nbytes for s in x.addressable_shards), default=0)
                   if isinstance(x, jax.Array) else np.asarray(x).nbytes)
                  for x in jax.tree.leaves(pure))
    return max(int(biggest), SAVE_INFLIGHT_BYTES if cap is None else int(cap))


def save_orbax(path: str | os.PathLike, cfg: ModelConfig, state: Any,
               tokenizer_dir: str | os.PathLike | None = None, *,
               inflight_bytes: int | None = None) -> pathlib.Path:
    """Write `state` (nnx.State or its pure dict) as an Orbax item + config/manifest JSON.

    Orbax copies each array to host before writing it; at most `inflight_bytes`
    (default SAVE_INFLIGHT_BYTES, raised to the largest leaf shard) are copied or being
    written at once, so saving adds a bounded amount to the model's own memory.

    The manifest holds each leaf's shape, dtype and sha256 (checked on restore: Orbax
    restores flipped bytes without complaint). The whole directory is built beside
    `path` and renamed into place when complete (`jlco.util.atomic.new_directory`), so an
    interrupted save never leaves a half-written checkpoint at `path`.
    """
    path = check_new_output(path)
    pure = _pure(state)
    leaves = _leaf_table(pure)
    for key, digest in _digests(pure).items():
        leaves[key]["sha256"] = digest
    manifest = {"format": "jlco-orbax", "version": _FORMAT_VERSION,
                "model_config": _config_to_json(cfg), "checksum": "sha256", "leaves": leaves}
    with atomic.new_directory(path) as tmp:
        gb = _inflight_bytes(pure, inflight_bytes) / 1e9   # Orbax counts 10**9-byte GB
        ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(
            save_concurrent_gb=gb, save_device_host_concurrent_gb=gb))
        ckptr.save(tmp / STATE_DIR, args=ocp.args.PyTreeSave(pure))
        if tokenizer_dir is not None:
            for fname in _TOKENIZER_FILES:
                src = pathlib.Path(tokenizer_dir) / fname
                if src.is_file():
                    (tmp / fname).write_bytes(src.read_bytes())
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1))
    return path


def _read_manifest_json(mfile: pathlib.Path) -> dict:
    try:
        m = json.loads(mfile.read_text())
    except (ValueError, OSError) as err:
        raise CheckpointError(f"{mfile}: cannot be read as JSON ({err}); the checkpoint is "
                              "damaged: convert it again") from None
    if not isinstance(m, dict):
        raise CheckpointError(f"{mfile}: must hold a JSON object")
    if m.get("format") != "jlco-orbax" or m.get("version") not in _READ_VERSIONS:
        raise CheckpointError(f"{mfile}: format {m.get('format')!r} version {m.get('version')!r}"
                              f" is invalid: allowed 'jlco-orbax' version "
                              f"{' or '.join(map(str, _READ_VERSIONS))}")
    for key in ("model_config", "leaves"):
        if not isinstance(m.get(key), dict):
            raise CheckpointError(f"{mfile}: field {key!r} is missing or not a JSON object")
    return m


def read_manifest(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, dict]]:
    """(ModelConfig, {leaf: {shape, dtype[, sha256]}}) of a jlco Orbax directory."""
    mfile = pathlib.Path(path) / MANIFEST_NAME
    if not mfile.is_file():
        raise CheckpointError(f"{str(path)!r} has no {MANIFEST_NAME} (not a jlco Orbax dir)")
    m = _read_manifest_json(mfile)
    return _config_from_json(m["model_config"], str(mfile)), m["leaves"]


def _check_manifest(saved: Mapping[str, dict], want: Mapping[str, dict], where: str) -> None:
    kind = {k: {f: v.get(f) for f in ("shape", "dtype")} if isinstance(v, dict) else v
            for k, v in saved.items()}
    problems = [f"leaf {k!r} missing from the checkpoint" for k in want if k not in kind]
    problems += [f"leaf {k!r} in the checkpoint is not in the model" for k in kind
                 if k not in want]
    problems += [f"leaf {k!r}: checkpoint {_describe(kind[k])}, model "
                 f"{w['dtype']}{w['shape']}" for k, w in want.items()
                 if k in kind and kind[k] != w]
    _raise_if(problems, pathlib.Path(where))


def _describe(entry: Any) -> str:
    if isinstance(entry, dict):
        return f"{entry.get('dtype')}{entry.get('shape')}"
    return f"malformed entry {entry!r}"


def abstract_model(cfg: ModelConfig):
    """(graphdef, abstract nnx.State) of the model, without allocating weights."""
    return nnx.split(nnx.eval_shape(lambda: DeepseekV32(cfg, rngs=nnx.Rngs(0))))


_FAILED_RESTORES: list = []


def _orbax_restore(path: pathlib.Path, target: Any) -> Any:
    """Orbax's restore, with any failure (a truncated or deleted file, a corrupt
    chunk: tensorstore, zarr and OCDBT each raise their own types, often with pages of
    traceback) turned into one CheckpointError naming the directory."""
    state_dir = path / STATE_DIR
    if not state_dir.is_dir():
        raise CheckpointError(f"Orbax checkpoint {str(path)!r} has no {STATE_DIR}/ directory; "
                              "it is incomplete: convert it again")
    ckptr = ocp.StandardCheckpointer()
    try:
        return ckptr.restore(state_dir, target)
    except Exception as err:  # noqa: BLE001 - see docstring: every failure is a bad file
        # Reads still in flight on Orbax's background loop print "Event loop is closed"
        # tracebacks if the checkpointer is collected (its loop closed) under them: keep
        # it alive; the entry points then exit through `jlco.util.cli.run_main`, which
        # skips the interpreter shutdown where the same happens.
        _FAILED_RESTORES.append(ckptr)
        first = (str(err).strip().splitlines() or [""])[0]
        first = first.split(" See full TensorStore details")[0][:300]
        raise CheckpointError(f"Orbax checkpoint {str(path)!r} cannot be restored "
                              f"({type(err).__name__}: {first}); its {STATE_DIR}/ files are "
                              "damaged or incomplete: convert it again") from None


def _verify(path: pathlib.Path, saved: Mapping[str, dict], restored: Any) -> None:
    """Compare each restored leaf's sha256 with the manifest's. Manifests written before
    checksums were recorded (version 1) load with a warning line."""
    if not all(isinstance(v, dict) and "sha256" in v for v in saved.values()):
        print(f"warning: {path / MANIFEST_NAME} records no leaf checksums (written by an "
              "older jlco); loading without verification; convert again to add them",
              file=sys.stderr, flush=True)
        return
    got = _digests(restored)
    bad = sorted(k for k, d in got.items() if saved[k]["sha256"] != d)
    if bad:
        what = "1 leaf fails its" if len(bad) == 1 else f"{len(bad)} leaves fail their"
        raise CheckpointError(f"Orbax checkpoint {str(path)!r}: {what} sha256 checksum, "
                              f"e.g. {bad[0]!r} (manifest "
                              f"{saved[bad[0]]['sha256'][:12]}..., restored "
                              f"{got[bad[0]][:12]}...): the files are corrupt; convert again")


def restore_orbax(path: str | os.PathLike, abstract_state: Any = None, *,
                  verify: bool = True) -> tuple[ModelConfig, Any]:
    """Restore (cfg, state). `abstract_state` defaults to the model's (nnx.eval_shape);
    every leaf's shape and dtype must match what was saved, and (`verify`) its bytes the
    sha256 recorded at save time."""
    path = pathlib.Path(path).absolute()
    cfg, leaves = read_manifest(path)
    if abstract_state is None:
        abstract_state = abstract_model(cfg)[1]
    target = _pure(abstract_state)
    _check_manifest(leaves, _leaf_table(target), str(path))
    restored = _orbax_restore(path, target)
    if verify:
        _verify(path, leaves, restored)
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
               *, shardings: Shardings = None, progress: bool = True, verify: bool = True):
    """Return (ModelConfig, DeepseekV32, info) from a HF or jlco Orbax directory.

    For HF, `cfg_overrides` apply on top of config.json (e.g. dtype='float32'; without
    one the model computes in bfloat16 — `checkpoint_dtype` says what the checkpoint
    itself asks for, and `jlco.generate` passes that); for Orbax, they must not change
    any weight's shape or dtype (the manifest check says which), and `verify` checks
    every leaf against the sha256 recorded when it was converted.

    `shardings` places each parameter: one `jax.sharding.Sharding` for all, a callable
    (path tuple, abstract nnx.Variable carrying its logical axes) → Sharding, or a pytree
    like the model's state with Sharding leaves; default: the first device. HF weights
    stream (jlco.checkpoint.stream): each device's slice is read from the memory-mapped
    files, so host memory stays near one tensor beyond the device arrays.
    """
    overrides = dict(cfg_overrides or {})
    kind = checkpoint_kind(path)
    if kind == "hf":
        cfg = read_hf_config(path, **overrides)
        index = open_hf_checkpoint(path, cfg_overrides=overrides)
        dt = load_dtype(cfg.dtype)
        model = build_model(index, dt, shardings=shardings, progress=progress)
        info = {"kind": kind, "path": str(index.path), "has_mtp": index.has_mtp,
                "tokenizer_path": index.tokenizer_path, "tensors": len(index.plan),
                "bytes": index.nbytes(dt)}
        return index.config, model, info
    saved_cfg, _ = read_manifest(path)
    cfg = dataclasses.replace(saved_cfg, **overrides)
    graphdef, abstract = abstract_model(cfg)
    if shardings is not None:
        for p, var in nnx.to_flat_state(abstract):
            want = var.get_value()
            var.set_value(jax.ShapeDtypeStruct(want.shape, want.dtype,
                                               sharding=sharding_for(shardings, tuple(p), var)))
    _, state = restore_orbax(path, abstract, verify=verify)
    model = nnx.merge(graphdef, state)
    tok = pathlib.Path(path) / "tokenizer.json"
    info = {"kind": kind, "path": str(pathlib.Path(path).absolute()),
            "has_mtp": cfg.num_nextn_predict_layers > 0,
            "tokenizer_path": tok if tok.is_file() else None}
    return cfg, model, info
