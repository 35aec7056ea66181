"""Expert-parallel MoE: the routed experts split over the mesh axis that `RULES` gives the
logical "expert" axis, tokens dispatched to the device holding their expert and the
results combined back with `jax.lax.all_to_all`, inside `jax.shard_map`.

With P devices on that axis and E experts, device p holds experts p·E/P .. (p+1)·E/P - 1.
The router ran replicated, so every device has every token; each takes its 1/P share of
the tokens (padded to a multiple of P), and per shard (n tokens, k assignments each):

    sort the n·k assignments by destination device; a = n·k
    send  [P, a, d]  row j for device q = the token of q's j-th assignment (zeros after)
    eid   [P, a]     its expert id local to q (-1 = empty row)
    all_to_all(send), all_to_all(eid)       recv[q] = what device q sent here
    local experts over the P·a received rows (empty rows give zeros)
    all_to_all(results)                      back[q] = q's results for what was sent to q
    combine: Σ_k w · back[dest, rank] per token (f32), then the token shards re-join
             (the results go back in the experts' dtype: bf16 for the real model)

With a "tensor" axis too, each device's experts are split on their hidden dimension as
the parameters are stored (gate/up by column, down by row): the received rows are the same
on the tensor peers, each computes a partial down-projection and a psum over "tensor"
completes it before the results go back.

The buffers have a fixed capacity of every local assignment per destination, so no token
is ever dropped whatever the routing (dropless, like the single-device path) at P× the
dispatch memory of an exact-size exchange; `ragged_all_to_all` with exchanged counts is
the GPU/TPU optimisation (XLA:CPU does not implement it). The experts run as in
`jlco.model.moe.Experts`: grouped matmuls (`ragged_dot`) where they are native, every
local expert densely over the received rows on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jlco.parallel.mesh import mesh_axis, spec_for

EXPERT_AXIS = mesh_axis("expert")
HIDDEN_AXIS = mesh_axis("mlp")     # the experts' hidden dimension (tensor parallelism)


def parallel_size() -> int:
    """Devices the routed experts are split over under the active (abstract) mesh; 1
    without a mesh (the single-device path)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return 1
    return dict(mesh.shape).get(EXPERT_AXIS, 1)


def swiglu(gate, up):
    return jax.nn.silu(gate) * up


def experts_parallel(x, w, ids, gate, up, down, act=swiglu):
    """x [n, d], w / ids [n, k] (replicated), gate / up [E, d, f], down [E, f, d] (split
    over the expert axis) → Σ_k w · expert_ids(x) [n, d] in x.dtype, as
    `Experts.__call__` computes on one device. `act`(gate, up) is the experts'
    activation (elementwise: DeepSeek-V4 clamps before SwiGLU)."""
    p, e = parallel_size(), gate.shape[0]
    if e % p:
        raise ValueError(f"model.n_routed_experts={e} is not divisible by mesh.expert={p}")
    n = x.shape[0]
    pad = -n % p
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
        w = jnp.pad(w, ((0, pad), (0, 0)))
        ids = jnp.pad(ids, ((0, pad), (0, 0)), constant_values=-1)
    mesh_shape = dict(jax.sharding.get_abstract_mesh().shape)
    up_spec = spec_for(("expert", "embed", "mlp"), gate.shape, mesh_shape)
    down_spec = spec_for(("expert", "mlp", "embed"), down.shape, mesh_shape)
    split = PartitionSpec(EXPERT_AXIS)
    body = jax.shard_map(functools.partial(_dispatch_combine, tensor=HIDDEN_AXIS in up_spec,
                                           act=act),
                         in_specs=(split, split, split, up_spec, up_spec, down_spec),
                         out_specs=split)
    with jax.named_scope("expert_parallel"):
        y = body(x, w, ids, gate, up, down)
        # The token shards re-join here: the residual stream is replicated over "expert"
        # (with data ranks, this runs inside each rank's step on the rank's own tokens).
        return jax.lax.with_sharding_constraint(y, PartitionSpec())[:n]


def _dispatch_combine(x, w, ids, gate, up, down, *, tensor: bool, act=swiglu):
    """One device's shard: x [n, d] tokens, w / ids [n, k], its E/P local experts (with
    `tensor`, a slice of their hidden dimension: the partial outputs are summed over the
    tensor axis before they go back)."""
    p = jax.lax.axis_size(EXPERT_AXIS)
    n, k = ids.shape
    e_local, d = gate.shape[0], x.shape[-1]
    flat = ids.reshape(-1)
    a = flat.shape[0]
    dest = jnp.where(flat >= 0, flat // e_local, p)            # p: padding, sent nowhere
    order = jnp.argsort(dest, stable=True)
    dest_s = dest[order]
    counts = jnp.zeros((p + 1,), jnp.int32).at[dest].add(1)
    rank = jnp.arange(a, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[dest_s]
    token = order // k                                          # of each sorted one
    send = jnp.zeros((p, a, d), x.dtype).at[dest_s, rank].set(x[token], mode="drop")
    eid = jnp.full((p, a), -1, jnp.int32).at[dest_s, rank].set(flat[order] % e_local,
                                                                mode="drop")
    with jax.named_scope("dispatch"):
        recv = jax.lax.all_to_all(send, EXPERT_AXIS, 0, 0)
        recv_eid = jax.lax.all_to_all(eid, EXPERT_AXIS, 0, 0)
    ys = jax.lax.platform_dependent(recv.reshape(p * a, d), recv_eid.reshape(-1), gate, up,
                                   down, cpu=functools.partial(local_dense, act=act),
                                   default=functools.partial(local_grouped, act=act))
    if tensor:
        ys = jax.lax.psum(ys, HIDDEN_AXIS)
    with jax.named_scope("combine"):
        # Back in the experts' own output dtype (what their matmuls rounded to), then
        # weighted and summed over each token's k assignments in a fixed order (a
        # permutation scatter, no duplicate-index adds: deterministic on GPU too).
        back = jax.lax.all_to_all(ys.astype(gate.dtype).reshape(p, a, d), EXPERT_AXIS, 0, 0)
    got = back.at[dest_s, rank].get(mode="fill", fill_value=0).astype(jnp.float32)
    got = jnp.zeros((a, d), jnp.float32).at[order].set(got)       # assignment order
    return jnp.einsum("nkd,nk->nd", got.reshape(n, k, d), w.astype(jnp.float32)).astype(x.dtype)


def local_dense(rows, eid, gate, up, down, act=swiglu):
    """Every local expert over every received row, each row keeping its own expert's
    output (XLA:CPU has no grouped matmul; see `Experts._dense`) → [m, d] f32; rows with
    eid -1 give zeros."""
    e = gate.shape[0]
    pick = (eid[:, None] == jnp.arange(e, dtype=eid.dtype)[None]).astype(jnp.float32)
    xs = jnp.broadcast_to(rows.astype(gate.dtype), (e, *rows.shape))
    hid = act(jnp.einsum("end,edf->enf", xs, gate), jnp.einsum("end,edf->enf", xs, up))
    ys = jnp.einsum("enf,efd->end", hid, down).astype(jnp.float32)
    return jnp.einsum("end,ne->nd", ys, pick)


def local_grouped(rows, eid, gate, up, down, act=swiglu):
    """Received rows sorted by local expert through grouped matmuls (`ragged_dot`), cost
    following the rows, not the experts → [m, d] f32; rows with eid -1 give zeros."""
    e = gate.shape[0]
    key = jnp.where(eid >= 0, eid, e)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.zeros((e + 1,), jnp.int32).at[key].add(1)[:e]
    xs = rows[order].astype(gate.dtype)
    hid = act(jax.lax.ragged_dot(xs, gate, sizes), jax.lax.ragged_dot(xs, up, sizes))
    ys = jax.lax.ragged_dot(hid, down, sizes).astype(jnp.float32)
    ys = jnp.where((key[order] < e)[:, None], ys, 0.0)
    return jnp.zeros_like(ys).at[order].set(ys)
