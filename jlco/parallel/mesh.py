"""The device mesh, the logical-axis rules, and placing a model's parameters on the mesh.

Every parameter names its logical axes where it is defined (`jlco.model.layers.param`,
`out_sharding` metadata); `RULES` below is the one place that maps them to mesh axes:

    logical axis                         mesh axis    why
    "expert"  (routed experts, leading)  "expert"     expert parallelism (`jlco.parallel.expert`)
    "mlp"     (MLP / expert hidden)      "tensor"     Megatron-style column/row split
    "heads", "index_heads"               "tensor"     attention heads
    "vocab"   (embedding, LM heads)      "tensor"     vocabulary split
    "embed", "norm", "q_lora", "kv_lora", None        replicated

A dimension whose size the mesh axis does not divide stays replicated (correct, only less
split), except the routed experts: `check_mesh` refuses n_routed_experts % expert != 0 at
start-up. With data = 1 the decode cache is replicated: every device runs attention for
every request, and the offloaded host pool has one copy in each device's host memory.
With data > 1 (`jlco.parallel.data`) the batch slots, their caches and the host pool are
split over the data ranks, and the engine's steps run per rank.

The mesh's axis types are Auto: XLA's SPMD partitioner propagates the parameter
shardings through the jitted steps (tensor parallelism of the attention, dense MLP,
shared experts and LM head is its choice of collectives; a Pallas kernel's operands get
gathered around it), while the routed experts run by hand in `jax.shard_map`
(`jlco.parallel.expert`), split over "expert" and, inside each device's experts, over
"tensor" on their hidden dimension.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import (
    AxisType,
    Mesh,
    NamedSharding,
    PartitionSpec,
    SingleDeviceSharding,
)

from jlco.config import Config

AXES = ("data", "expert", "tensor")

RULES: dict[str, str] = {
    "expert": "expert",
    "mlp": "tensor",
    "heads": "tensor",
    "index_heads": "tensor",
    "vocab": "tensor",
}


def make_mesh(cfg: Config, devices=None) -> Mesh:
    """The ("data", "expert", "tensor") mesh of `cfg.mesh` over `devices` (default:
    jax.devices()). A ValueError names the mesh fields when their product is not the
    device count."""
    devices = list(jax.devices() if devices is None else devices)
    m = cfg.mesh
    if m.num_devices != len(devices):
        raise ValueError(f"mesh.data={m.data} x mesh.expert={m.expert} x mesh.tensor={m.tensor} "
                         f"= {m.num_devices} devices, but {len(devices)} device(s) are "
                         f"available ({devices[0].platform}); the product must equal the "
                         "device count")
    grid = np.asarray(devices, dtype=object).reshape(m.data, m.expert, m.tensor)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def check_mesh(cfg: Config) -> None:
    """Refuse, before any weight is placed, a mesh the model or the engine cannot run:
    a ValueError for a model/mesh mismatch, NotImplementedError for what is not built
    yet (each message one line naming the fields)."""
    m, model = cfg.mesh, cfg.model
    if model.n_routed_experts % m.expert:
        raise ValueError(f"model.n_routed_experts={model.n_routed_experts} is not divisible by "
                         f"mesh.expert={m.expert}: every expert-parallel device must hold the "
                         "same number of routed experts; allowed mesh.expert dividing "
                         f"{model.n_routed_experts}")
    check_batch(cfg.engine.max_batch_size, m.data)
    if cfg.cache.offload and jax.process_count() > 1 and \
            cfg.resolved_fetch_path() == "host_driven":
        raise NotImplementedError(
            f"cache.fetch_path={cfg.cache.fetch_path!r} (host-driven, storage "
            f"{cfg.cache.storage!r}) is not built for {jax.process_count()} processes: its "
            "host pool reads rows that the mesh splits across processes; allowed "
            "cache.fetch_path='in_jit' with cache.storage pinned_host or unpinned_host")


def check_batch(batch: int, ranks: int) -> None:
    """The batch slots split evenly over the data ranks, or a ValueError naming both."""
    if batch % ranks:
        raise ValueError(f"engine.max_batch_size={batch} is not divisible by mesh.data={ranks}: "
                         "every data rank holds the same number of batch slots; allowed "
                         f"a multiple of {ranks}")


def mesh_axis(logical: str | None) -> str | None:
    """The mesh axis a logical axis is split over (None: replicated)."""
    return None if logical is None else RULES.get(logical)


def spec_for(logical: tuple[str | None, ...], shape: tuple[int, ...] | None = None,
             mesh_shape: dict[str, int] | None = None) -> PartitionSpec:
    """PartitionSpec of a parameter with these logical axes; with `shape` and
    `mesh_shape`, a dimension the mesh axis does not divide stays replicated."""
    out = []
    for i, name in enumerate(logical):
        axis = mesh_axis(name)
        if axis is not None and shape is not None and mesh_shape is not None:
            size = mesh_shape.get(axis, 1)
            if size == 1 or shape[i] % size:
                axis = None
        out.append(axis)
    return PartitionSpec(*out)


def param_sharding(mesh: Mesh):
    """For `jlco.checkpoint.load.load_model(shardings=...)`: (path, abstract variable) →
    the NamedSharding `shard_model` would give it, so a checkpoint loads straight into
    its shards (each device reads only its slices)."""
    mesh_shape = dict(mesh.shape)

    def for_param(path, var) -> NamedSharding:
        shape = tuple(np.shape(var.get_value()))
        logical = tuple(var.get_metadata().get("out_sharding") or ())
        logical = logical + (None,) * (len(shape) - len(logical))
        return NamedSharding(mesh, spec_for(logical, shape, mesh_shape))
    return for_param


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Place every parameter of `model` on `mesh` by its logical axes (`RULES`); the
    model is updated in place and returned. Non-parameter state is replicated."""
    state = nnx.state(model)
    logical = nnx.get_partition_spec(state)
    shape = dict(mesh.shape)

    def place(spec, x):
        names = tuple(spec) if isinstance(spec, PartitionSpec) else (None,) * np.ndim(x)
        names = names + (None,) * (np.ndim(x) - len(names))
        return NamedSharding(mesh, spec_for(names, np.shape(x), shape))

    shardings = jax.tree.map(place, logical, state,
                             is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None)
    nnx.update(model, jax.device_put(state, shardings))
    return model


def active_mesh() -> Mesh | None:
    """The mesh set by `jax.set_mesh` when it spans more than one device, else None."""
    try:
        mesh = jax.sharding.get_mesh()
    except ValueError:   # inside a trace (e.g. eval_shape of the cache for byte counts)
        return None
    if mesh is None or getattr(mesh, "empty", True) or mesh.size <= 1:
        return None
    return mesh


def replicated(memory_kind: str | None = None):
    """Sharding of an array every device holds whole: replicated over the active mesh, or
    on the first device without one (what the single-device engine uses)."""
    mesh = active_mesh()
    if mesh is None:
        return SingleDeviceSharding(jax.devices()[0], memory_kind=memory_kind)
    return NamedSharding(mesh, PartitionSpec(), memory_kind=memory_kind)


def on_mesh(sharding):
    """`sharding` unchanged without an active mesh; under one, a sharding that is not on
    the mesh becomes replicated over it (same memory kind), so a jitted step's pinned
    output shardings and its mesh-sharded parameters share one device set."""
    mesh = active_mesh()
    if mesh is None or (isinstance(sharding, NamedSharding) and sharding.mesh == mesh):
        return sharding
    return NamedSharding(mesh, PartitionSpec(), memory_kind=sharding.memory_kind)
