"""A model choice, before any weight is loaded: a checkpoint's model (HF or jlco Orbax;
config and compute dtype read without the weights), or a random-weight one that
`jlco.launch.load` picks (its size is a planning figure, so the choosing lives there).
Then the weights: the checkpoint's, or random ones built from a seed.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any


@dataclasses.dataclass
class ModelChoice:
    """The model config to run (weights not loaded yet) and what stderr should say."""
    model: Any                  # jlco.config.ModelConfig, or a V4Config (deepseek_v4)
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
    if kind == "hf" and is_v4_checkpoint(path):
        from jlco.checkpoint.deepseek_v4 import read_v4_config
        dtype, why = ((dtype, "--dtype") if dtype else
                      (saved, f"from {where}") if saved else ("bfloat16", f"{where}: default"))
        mcfg = read_v4_config(path, dtype=dtype)
        tok = pathlib.Path(path) / "tokenizer.json"
        return ModelChoice(mcfg, f"checkpoint {path} (HF, deepseek_v4): dtype {mcfg.dtype} "
                                 f"({why})", tok if tok.is_file() else None, checkpoint=path)
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


def is_v4_checkpoint(path) -> bool:
    """Whether a HF checkpoint's config.json names model_type deepseek_v4."""
    import json
    try:
        d = json.loads((pathlib.Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False          # the MLA reader reports what is wrong with it
    return isinstance(d, dict) and d.get("model_type") == "deepseek_v4"


def load_weights(choice: ModelChoice, *, seed: int = 0, verify: bool = True,
                 num_draft_tokens: int = 0, shardings=None):
    """(model config, model): the checkpoint's weights, or random ones (seeded).
    `shardings` (see `load_model`): where each parameter's slices go (a mesh's)."""
    if choice.checkpoint is None:
        from jlco.checkpoint.random_store import random_model
        return choice.model, random_model(choice.model, seed)
    if choice.model.model_type == "deepseek_v4":   # read whole; the caller shards it
        from jlco.checkpoint.deepseek_v4 import load_v4
        if num_draft_tokens:
            raise ValueError(f"--num_draft_tokens={num_draft_tokens}: MTP is not implemented "
                             "for deepseek_v4 (its mtp.* tensors are not loaded)")
        return load_v4(choice.checkpoint, dtype=choice.model.dtype)
    from jlco.checkpoint.load import load_model
    path = choice.checkpoint
    mcfg, model, info = load_model(path, {"dtype": choice.model.dtype}, verify=verify,
                                   shardings=shardings)
    if num_draft_tokens and not info["has_mtp"]:
        raise ValueError(f"--num_draft_tokens={num_draft_tokens}: MTP is unavailable, "
                         f"checkpoint {path} has no MTP layer (model.layers."
                         f"{mcfg.num_hidden_layers}.*); checkpoints saved by transformers carry none")
    return mcfg, model
