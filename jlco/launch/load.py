"""The load sequence of `jlco.generate` and `jlco.serve`: choose the model, check and
build the mesh, load the weights into its shards.

The steps are separate calls because each program works between them: generate
tokenizes its prompts and sizes the engine after the choice (the model's vocabulary and
positions bound them), serve opens its port before the weights load. Whatever can fail
on bad input (the choice, the joint config, the mesh against the model and the devices)
fails before any weight is read. Imports stay inside the functions, so an entry point's
flag errors stay fast.
"""

from __future__ import annotations

import dataclasses
import pathlib

_ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
TINY_CONFIG = _ROOT / "configs" / "tiny.py"
V4_TINY_CONFIG = _ROOT / "configs" / "deepseek_v4_tiny.py"   # a deepseek_v4 config's stand-in
RANDOM_MODEL_MAX_BYTES = 2 << 30   # larger configs' models get tiny's shape (random weights)


def choose_model(checkpoint: str | None, base, dtype: str | None, seed: int):
    """The `ModelChoice` for these flags: the checkpoint's model (`dtype`, else its own),
    or without one the random-weight model for config `base`."""
    from jlco.checkpoint.choice import checkpoint_choice
    if checkpoint is not None:
        return checkpoint_choice(checkpoint, dtype)
    return random_choice(base, dtype, seed)


def random_choice(base, dtype: str | None, seed: int):
    """The random-weight model for config `base`: its own when small enough to build,
    else configs/tiny.py's model section (a deepseek_v4 config: configs/deepseek_v4_tiny.py's;
    its positions raised to the config's context). Its size: the planner's parameter count
    (`jlco.planning.params`, V4: `jlco.planning.v4`), 2 bytes each (f32: 4)."""
    from jlco.checkpoint.choice import ModelChoice
    from jlco.config import load_config
    m, cfg_name = base.model, base.name
    width = 4 if (dtype or m.dtype) == "float32" else 2
    if base.is_v4:
        from jlco.planning.v4 import weights
        params = weights(m, "bf16").params_total
    else:
        from jlco.planning.params import weight_bytes
        params = weight_bytes(m, ep=1, weight_format="bf16").params_total
    nbytes = params * width
    own = nbytes <= RANDOM_MODEL_MAX_BYTES
    stand_in = V4_TINY_CONFIG if base.is_v4 else TINY_CONFIG
    if own:
        what = f"the {cfg_name} config's model"
    else:
        tiny = load_config(stand_in).model
        m = dataclasses.replace(tiny, max_position_embeddings=max(
            tiny.max_position_embeddings, base.engine.max_context_len))
        what = (f"configs/{stand_in.name}'s model section: the {cfg_name} config's model has "
                f"{nbytes / 2**30:.0f} GiB of weights, too big to build with random ones; "
                f"its engine context ({base.engine.max_context_len}) and cache settings "
                f"(offload {'on' if base.cache.offload else 'off'}, kv_format "
                f"{base.cache.kv_format}) are kept")
    dtype_why = f"{cfg_name} model.dtype" if own else f"configs/{stand_in.name} model.dtype"
    if dtype:
        m, dtype_why = dataclasses.replace(m, dtype=dtype), "--dtype"
    return ModelChoice(m, f"no --checkpoint: using a small RANDOM-WEIGHT model ({what}; seed "
                          f"{seed}; dtype {m.dtype} from {dtype_why}); outputs are "
                          "meaningless tokens", None, own)


def checked_mesh(cfg):
    """The jax mesh of `cfg.mesh` (None for one device), checked against the model, the
    engine and the device count before any weight is loaded."""
    if cfg.mesh.num_devices == 1:
        return None
    from jlco.parallel.mesh import check_mesh, make_mesh
    check_mesh(cfg)
    return make_mesh(cfg)


def load_sharded(choice, cfg, mesh, *, seed: int, verify: bool):
    """(cfg with the loaded model's config, model): the choice's weights (a checkpoint
    loads straight into `mesh`'s shards; random ones are seeded), then every parameter
    placed on the mesh. The model is checked against the mesh again: a checkpoint's
    model may differ from the one the config named."""
    from jlco.checkpoint.choice import load_weights
    shardings = None
    if mesh is not None:
        from jlco.parallel.mesh import param_sharding
        shardings = param_sharding(mesh)
    mcfg, model = load_weights(choice, seed=seed, verify=verify,
                               num_draft_tokens=cfg.engine.num_draft_tokens,
                               shardings=shardings)
    cfg = cfg.replace(model=mcfg)
    if mesh is not None:
        from jlco.parallel.mesh import check_mesh, shard_model
        check_mesh(cfg)
        shard_model(model, mesh)
    return cfg, model
