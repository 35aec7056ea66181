"""Which model a program runs, before any weight is loaded: a checkpoint's (HF or jlco
Orbax; config and compute dtype read without the weights) or, without a checkpoint, a
small RANDOM-WEIGHT model — the config's own when its random weights are small enough to
build, else configs/tiny.py's model section with the config's context. Then the weights.
Shared by `jlco.generate` and `jlco.serve`, so both run the same model for the same flags.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

_ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
TINY_CONFIG = _ROOT / "configs" / "tiny.py"
RANDOM_MODEL_MAX_BYTES = 2 << 30   # larger configs' models get tiny's shape (random weights)


@dataclasses.dataclass
class ModelChoice:
    """The model config to run (weights not loaded yet) and what stderr should say."""
    model: Any                  # jlco.config.ModelConfig
    banner: str
    tokenizer_path: pathlib.Path | None = None
    own_model: bool = True      # False: the config's model was replaced by tiny's shape
    checkpoint: str | None = None


def checkpoint_choice(path: str, dtype: str | None) -> ModelChoice:
    """The checkpoint's model config and compute dtype (`dtype`, else the checkpoint's
    own, else bfloat16), read without its weights."""
    from jlco.checkpoint.load import (
        checkpoint_dtype,
        checkpoint_kind,
        read_hf_config,
        read_manifest,
    )
    kind = checkpoint_kind(path)
    saved, where = checkpoint_dtype(path)
    if kind == "orbax":
        if dtype and dtype != saved:
            raise ValueError(f"--dtype={dtype} is invalid for {path!r}: the Orbax checkpoint "
                             f"holds {saved} weights; allowed --dtype={saved} (or convert the "
                             f"HF checkpoint again with --dtype {dtype})")
        mcfg, why = read_manifest(path)[0], f"stored in {where}"
    else:
        dtype, why = ((dtype, "--dtype") if dtype else
                      (saved, f"from {where}") if saved else ("bfloat16", f"{where}: default"))
        mcfg = read_hf_config(path, dtype=dtype)
    tok = pathlib.Path(path) / "tokenizer.json"
    return ModelChoice(mcfg, f"checkpoint {path} ({'jlco Orbax' if kind == 'orbax' else 'HF'}): "
                             f"dtype {mcfg.dtype} ({why})", tok if tok.is_file() else None,
                       checkpoint=path)


def random_choice(base, dtype: str | None, seed: int) -> ModelChoice:
    """The random-weight model for config `base`: its own when small enough to build,
    else configs/tiny.py's model section (its positions raised to the config's context)."""
    from jlco.config import load_config
    from jlco.planning.params import weight_bytes
    m, cfg_name = base.model, base.name
    width = 4 if (dtype or m.dtype) == "float32" else 2
    nbytes = weight_bytes(m, ep=1, weight_format="bf16").params_total * width
    own = nbytes <= RANDOM_MODEL_MAX_BYTES
    if own:
        what = f"the {cfg_name} config's model"
    else:
        tiny = load_config(TINY_CONFIG).model
        m = dataclasses.replace(tiny, max_position_embeddings=max(
            tiny.max_position_embeddings, base.engine.max_context_len))
        what = (f"configs/tiny.py's model section: the {cfg_name} config's model has "
                f"{nbytes / 2**30:.0f} GiB of weights, too big to build with random ones; "
                f"its engine context ({base.engine.max_context_len}) and cache settings "
                f"(offload {'on' if base.cache.offload else 'off'}, kv_format "
                f"{base.cache.kv_format}) are kept")
    dtype_why = f"{cfg_name} model.dtype" if own else "configs/tiny.py model.dtype"
    if dtype:
        m, dtype_why = dataclasses.replace(m, dtype=dtype), "--dtype"
    return ModelChoice(m, f"no --checkpoint: using a small RANDOM-WEIGHT model ({what}; seed "
                          f"{seed}; dtype {m.dtype} from {dtype_why}); outputs are "
                          "meaningless tokens", None, own)


def load_weights(choice: ModelChoice, *, seed: int = 0, verify: bool = True,
                 num_draft_tokens: int = 0, shardings=None):
    """(model config, model): the checkpoint's weights, or random ones (seeded).
    `shardings` (see `load_model`): where each parameter's slices go (a mesh's)."""
    if choice.checkpoint is None:
        from jlco.checkpoint.random_store import random_model
        return choice.model, random_model(choice.model, seed)
    from jlco.checkpoint.load import load_model
    path = choice.checkpoint
    mcfg, model, info = load_model(path, {"dtype": choice.model.dtype}, verify=verify,
                                   shardings=shardings)
    if num_draft_tokens and not info["has_mtp"]:
        raise ValueError(f"--num_draft_tokens={num_draft_tokens}: MTP is unavailable, "
                         f"checkpoint {path} has no MTP layer (model.layers."
                         f"{mcfg.num_hidden_layers}.*); checkpoints saved by transformers carry none")
    return mcfg, model
