"""The device mesh the planner and the simulator plan for: `--mesh data=D,expert=E,tensor=T`.

Conventions (what "per device" and "per host" mean in `jlco.plan` / `jlco.sim`):

- The axes multiply, as in a JAX `Mesh` of shape (data, expert, tensor): D·E·T devices.
  Device index = (d·E + e)·T + t (row-major, tensor innermost, as `jax.make_mesh` orders
  a host's devices), and host = index // devices_per_host; tensor must divide
  devices_per_host so that one tensor group never spans two hosts.
- Weights (`jlco.planning.params.weight_bytes(ep=E, tensor=T)`): routed experts are split
  over `expert` (ceil(256 / E) whole experts per device); every matmul with a head,
  FFN-intermediate or vocabulary axis (attention q_b / kv_b / o_proj, indexer wq_b and
  weights_proj, dense FFN, shared and routed expert FFNs, embedding, lm_head) is split
  over `tensor`; the low-rank down projections, norms and router are replicated; all of
  it is replicated over `data`.
- Requests: attention is data-parallel over data × expert (DP attention beside expert-
  parallel MoE, as DeepSeek's and ESS's deployments run it: otherwise the E devices of an
  expert group would recompute the same attention and each hold the same caches). So a
  request lives on one (data, expert) coordinate, its "attention rank", and the T devices
  of that rank share it. MLA's latent row and the indexer key are single-head (one row per
  token for all heads), so tensor parallelism cannot split the caches: each of the T
  devices holds the whole indexer cache and hot buffer of its rank's requests. Per-token
  activations are counted unsplit (an upper bound for T > 1).
- Host pool: each attention rank's latent cache lives in the pinned memory of the host
  its devices sit on; a host holds devices_per_host / T attention ranks.

The weight split is the one `jlco.parallel.mesh.RULES` applies (expert -> "expert";
mlp, heads, index_heads, vocab -> "tensor"; low-rank and norm axes replicated), except
that a size the axis does not divide is counted rounded up here (the engine keeps it
replicated, and refuses n_routed_experts % expert != 0 at start-up).

The engine splits requests over the "data" axis only (`jlco.parallel.data`): the expert
and tensor devices of one data rank run attention for the same requests. Per-device
figures are the same either way; what differs is the mesh-wide request count, planned
here as per-device batch × data × expert (DP attention over every device, as SGLang
runs it), in the engine the per-device batch × data.

The existing `--ep N` flag means the mesh data=1,expert=N,tensor=1 (N devices, DP
attention over all of them, EP N: the seed's "one rank of an EP-N deployment"). Giving
`--ep` together with `--mesh` is refused: the expert degree has one home.
"""

from __future__ import annotations

import dataclasses

AXES = ("data", "expert", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Sizes of the (data, expert, tensor) mesh axes; see the module docstring."""
    data: int = 1
    expert: int = 1
    tensor: int = 1

    def __post_init__(self):
        for a in AXES:
            v = getattr(self, a)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"mesh {a}={v!r} is invalid: allowed a positive integer")

    @property
    def devices(self) -> int:
        return self.data * self.expert * self.tensor

    @property
    def attention_ranks(self) -> int:
        """Groups of devices that own distinct requests (data × expert)."""
        return self.data * self.expert

    def text(self) -> str:
        return ",".join(f"{a}={getattr(self, a)}" for a in AXES)

    def as_dict(self) -> dict:
        return dict(data=self.data, expert=self.expert, tensor=self.tensor,
                    devices=self.devices, attention_ranks=self.attention_ranks)


def parse_mesh(text: str) -> MeshShape:
    """'data=8,expert=8' -> MeshShape(8, 8, 1). Axes left out are 1. Errors are one line
    naming the bad part (unknown axis, duplicate, non-integer or non-positive size)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"--mesh={text!r} is invalid: allowed 'data=D,expert=E,tensor=T' "
                         "(any subset, sizes >= 1)")
    sizes: dict[str, int] = {}
    for part in text.split(","):
        name, eq, value = part.strip().partition("=")
        name = name.strip()
        if not eq:
            raise ValueError(f"--mesh part {part.strip()!r} is invalid: expected AXIS=SIZE "
                             f"with AXIS one of {', '.join(AXES)}")
        if name not in AXES:
            raise ValueError(f"--mesh part {part.strip()!r} is invalid: unknown axis "
                             f"{name!r} (allowed {', '.join(AXES)})")
        if name in sizes:
            raise ValueError(f"--mesh part {part.strip()!r} is invalid: axis {name!r} given "
                             "twice")
        try:
            n = int(value.strip())
        except ValueError:
            n = 0
        if n < 1 or value.strip() != str(n):
            raise ValueError(f"--mesh part {part.strip()!r} is invalid: the size must be "
                             "an integer >= 1")
        sizes[name] = n
    return MeshShape(**sizes)


def mesh_overrides(text: str) -> dict:
    """--mesh text → `Config.replace` overrides of the config's mesh section (axes left
    out are 1), for the programs that run on a mesh (generate, serve)."""
    shape = parse_mesh(text)
    return {f"mesh__{a}": getattr(shape, a) for a in AXES}


def config_mesh(cfg) -> MeshShape | None:
    """The config's mesh section (`cfg.mesh`, `jlco.config.MeshConfig`) when it declares
    more than one device; None otherwise (no section, or the all-1 default, which means
    "one device, no mesh" and leaves the planner's --ep default in charge)."""
    m = getattr(cfg, "mesh", None)
    if m is None:
        return None
    shape = MeshShape(*(int(getattr(m, a, 1)) for a in AXES))
    return shape if shape.devices > 1 else None


@dataclasses.dataclass(frozen=True)
class HostLayout:
    """How the mesh's devices fall on hosts (see the module docstring)."""
    devices_per_host: int
    hosts: int
    devices_on_host: int          # on a full host (the last host may hold fewer)
    attention_ranks_per_host: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def host_layout(mesh: MeshShape, devices_per_host: int) -> HostLayout:
    """Hosts of `mesh` when each holds `devices_per_host` devices (tensor innermost)."""
    if isinstance(devices_per_host, bool) or not isinstance(devices_per_host, int) \
            or devices_per_host < 1:
        raise ValueError(f"devices_per_host={devices_per_host!r} is invalid: allowed a "
                         "positive integer")
    if devices_per_host % mesh.tensor:
        raise ValueError(f"mesh tensor={mesh.tensor} is invalid with devices_per_host="
                         f"{devices_per_host}: allowed a divisor of it (a tensor group "
                         "stays on one host)")
    on_host = min(devices_per_host, mesh.devices)
    return HostLayout(devices_per_host, -(-mesh.devices // devices_per_host), on_host,
                      on_host // mesh.tensor)
