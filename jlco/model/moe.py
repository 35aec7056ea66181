"""Dense MLP and the DeepSeek MoE block (sigmoid router, group-limited top-k, shared expert).

Routing (docs/facts.md §1): scores = sigmoid(x·W_gate) in f32; the correction bias only steers
*selection*; groups are ranked by the sum of their top-2 biased scores, the best
topk_group groups stay eligible; the chosen experts' unbiased scores are normalised and
scaled by routed_scaling_factor. Experts run as grouped matmuls (`ragged_dot`) over the
token→expert assignments sorted by expert, so cost scales with k, not with E (on CPU,
which has no grouped matmul, the chosen experts run one assignment at a time or every
expert over the tokens, and the engine holds each expert's weights as arrays of their own
so no matmul reads a copied slice: see `Experts`). Under a
mesh whose "expert" axis spans several devices the routed experts are split over it and
tokens reach them by all-to-all (`jlco.parallel.expert`); the router and the shared
experts run as the rest of the model does (replicated, or split by XLA over "tensor").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jlco import native
from jlco.config import ModelConfig
from jlco.model.layers import Fused, Linear, dtype_of, param
from jlco.parallel import expert as expert_parallel


_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _combine(w, ids, num_experts: int):
    """The combine matrix [n, E] f32: each token's routing weights at its chosen experts."""
    n = ids.shape[0]
    return jnp.zeros((n, num_experts), jnp.float32).at[jnp.arange(n)[:, None], ids].add(w)


class MLP(nnx.Module):
    def __init__(self, d: int, inter: int, *, dtype, rngs: nnx.Rngs):
        self.gate_proj = Linear(d, inter, axes=("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.up_proj = Linear(d, inter, axes=("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.down_proj = Linear(inter, d, axes=("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.gate_up = None     # `fuse`

    @staticmethod
    def act(gate: jax.Array, up: jax.Array) -> jax.Array:
        """SwiGLU: silu(gate) · up (DeepSeek-V4's experts clamp first: a subclass)."""
        return jax.nn.silu(gate) * up

    def fuse(self) -> bool:
        """gate | up as one matmul (`layers.Fused`), the separate weights dropped →
        whether it changed anything (False: already fused)."""
        if self.gate_up is not None:
            return False
        self.gate_up = nnx.data(Fused(self.gate_proj, self.up_proj))
        self.gate_proj = self.up_proj = None
        return True

    def __call__(self, x):
        if self.gate_up is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up(x)
        return self.down_proj(self.act(gate, up))


class Router(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.weight = param(rngs, (cfg.hidden_size, cfg.n_routed_experts), jnp.float32,
                            ("embed", None))
        self.e_score_correction_bias = param(rngs, (cfg.n_routed_experts,), jnp.float32,
                                             (None,), init="zeros")

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [n, d] → (weights [n, k] f32, expert ids [n, k] int32)."""
        cfg = self.cfg
        n, e, g = x.shape[0], cfg.n_routed_experts, cfg.n_group
        with jax.named_scope("router"):
            scores = jax.nn.sigmoid(jnp.einsum("nd,de->ne", x.astype(jnp.float32), self.weight[...]))
            choice = scores + self.e_score_correction_bias[...]
            top2 = jax.lax.top_k(choice.reshape(n, g, e // g), 2)[0]
            _, groups = jax.lax.top_k(jnp.sum(top2, axis=-1), cfg.topk_group)          # [n, tg]
            keep = jnp.zeros((n, g), bool).at[jnp.arange(n)[:, None], groups].set(True)
            keep = jnp.repeat(keep, e // g, axis=1)
            _, ids = jax.lax.top_k(jnp.where(keep, choice, -jnp.inf), cfg.num_experts_per_tok)
            w = jnp.take_along_axis(scores, ids, axis=1)
            if cfg.norm_topk_prob:
                w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
            return w * cfg.routed_scaling_factor, ids.astype(jnp.int32)


class Experts(nnx.Module):
    """Routed experts stacked on a leading expert axis (expert-parallel sharding axis)."""

    native = False      # per-expert products on the small-M kernel (`Linear.native`)

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dt, e, d, i = dtype_of(cfg), cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj = param(rngs, (e, d, i), dt, ("expert", "embed", "mlp"))
        self.up_proj = param(rngs, (e, d, i), dt, ("expert", "embed", "mlp"))
        self.down_proj = param(rngs, (e, i, d), dt, ("expert", "mlp", "embed"))

    @staticmethod
    def act(gate: jax.Array, up: jax.Array) -> jax.Array:
        """SwiGLU: silu(gate) · up (DeepSeek-V4's experts clamp first: a subclass)."""
        return jax.nn.silu(gate) * up

    def __call__(self, x: jax.Array, w: jax.Array, ids: jax.Array) -> jax.Array:
        """x [n, d], w/ids [n, k] → Σ_k w · expert_ids(x)  [n, d].

        Where `ragged_dot` is a native grouped matmul (GPU, TPU) the assignments run
        sorted by expert, so cost follows k, not E. XLA:CPU has no grouped matmul: it
        lowers `ragged_dot` to a dense product of every expert with all n·k sorted rows
        (k× the work of running each expert over the n tokens) and first copies every
        expert's weights into another layout. There, every expert runs over the n tokens
        straight from the stored weights and a combine matrix [n, E] keeps the chosen
        ones (measured at E 16, k 4, d 512: 2.1 vs 4.0 ms at n = 4, 345 vs 1086 ms at
        n = 2048). When the n·k assignments are at most half the experts (decode at small
        batch), only the chosen experts' weights are read: each assignment slices its
        expert, a token at a time (E 16, k 2, d 512, i 256, per layer against every
        expert: n 1 0.23 vs 1.6 ms, n 2 0.81 vs 1.9, n 4 1.2 vs 1.8). Those slices are
        copies; the engine on XLA:CPU therefore `unstack`s the weights, and then runs
        `_switched` (n·k <= E) or `_tiled`."""
        with jax.named_scope("experts"):
            if self.per_expert:
                fn = self._switched if ids.size <= self.num_experts else self._tiled
                return fn(x, w, ids)
            if expert_parallel.parallel_size() > 1:
                return expert_parallel.experts_parallel(
                    x, w, ids, self.gate_proj[...], self.up_proj[...], self.down_proj[...])
            cpu = self._picked if ids.size * 2 <= self.gate_proj.shape[0] else self._dense
            return jax.lax.platform_dependent(x, w, ids, cpu=cpu, default=self._grouped)

    @property
    def num_experts(self) -> int:
        value = self.gate_proj.get_value()
        return len(value) if isinstance(value, tuple) else value.shape[0]

    @property
    def per_expert(self) -> bool:
        """Whether each expert's weights are a buffer of their own (`unstack`)."""
        return isinstance(self.gate_proj.get_value(), tuple)

    def unstack(self) -> None:
        """Hold each routed expert's weights as arrays of their own (a tuple of E arrays
        per projection) instead of one stacked [E, ...] array. On XLA:CPU a matmul cannot
        read a slice of a buffer: every slice of the stacked weights (static or dynamic)
        is first copied, so reading a chosen expert cost its bytes three times. With
        buffers of their own, `lax.switch` hands the chosen expert's arrays to the
        matmul as they are (E 16, k 2, d 512, i 256, one layer at n 4: 0.7-0.8 vs 1.4-2.2
        ms picked from the stack, 1.3-1.9 ms every expert). Each expert's gate and up
        are held as one [d, 2i] array (one matmul: 43 → 36 µs an expert at batch 1),
        `up_proj` then None. For one device only: the stacked form is the one the
        checkpoint loader, the mesh and `ragged_dot` use."""
        if self.per_expert:
            return
        gate, up, down = (getattr(self, p).get_value() for p in _PROJECTIONS)
        e = gate.shape[0]
        self.gate_proj.set_value(tuple(jnp.concatenate([gate[j], up[j]], axis=1)
                                       for j in range(e)))
        self.down_proj.set_value(tuple(down[j] for j in range(e)))
        self.up_proj = None

    def _expert(self, e: int, xt):
        """Expert e (per-expert weights, gate | up fused) on the rows xt [m, d] → [m, d] f32."""
        gate_up, down = self.gate_proj.get_value()[e], self.down_proj.get_value()[e]
        xt = xt.astype(gate_up.dtype)
        mm = native.linear if self.native and native.supports(xt, gate_up) else jnp.matmul
        gate, up = jnp.split(mm(xt, gate_up), 2, axis=-1)
        return mm(self.act(gate, up), down).astype(jnp.float32)

    def _switched(self, x, w, ids):
        """Per-expert weights, few assignments: one assignment at a time, its expert picked
        by `lax.switch` (one switch in the program, whatever n·k)."""
        n, k = ids.shape
        flat_ids, flat_w = ids.reshape(-1), w.reshape(-1).astype(jnp.float32)
        branches = [functools.partial(self._expert, e) for e in range(self.num_experts)]

        def body(a, y):
            t = a // k
            row = jax.lax.dynamic_slice_in_dim(x, t, 1)
            out = jax.lax.switch(flat_ids[a], branches, row) * flat_w[a]
            return jax.lax.dynamic_update_slice_in_dim(
                y, jax.lax.dynamic_slice_in_dim(y, t, 1) + out, t, 0)

        y = jax.lax.fori_loop(0, n * k, body, jnp.zeros((n, x.shape[-1]), jnp.float32))
        return y.astype(x.dtype)

    def _tiled(self, x, w, ids):
        """Per-expert weights, many assignments (a prefill chunk, a large decode batch):
        the n·k assignments sorted by expert, then run in order in tiles of T rows, each
        tile one expert's (picked by `lax.switch`). Work is n·k rows plus at most T per
        expert, where running each chosen expert over all n tokens costs up to E/k times
        the rows (E 16, k 2, 512 tokens, one layer: 22-24 ms against 98 ms on a 2-core
        AVX2 box; 9 tokens 5.0 against 5.8 ms). T: n·k/E rounded up to a power of two,
        within 8..32."""
        n, k = ids.shape
        e, a, d = self.num_experts, ids.size, x.shape[-1]
        t = min(32, max(8, 1 << max(0, (a // e - 1).bit_length())))
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        token = order // k
        counts = jnp.bincount(flat, length=e).astype(jnp.int32)
        starts = jnp.cumsum(counts) - counts                   # first sorted row per expert
        tiles = (counts + t - 1) // t
        first_tile = jnp.cumsum(tiles) - tiles
        xs = jnp.concatenate([x[token], jnp.zeros((t, d), x.dtype)])   # a whole last tile
        branches = [functools.partial(self._expert, j) for j in range(e)]

        def body(i, ys):
            j = (jnp.searchsorted(first_tile, i, side="right") - 1).astype(jnp.int32)
            lo = starts[j] + (i - first_tile[j]) * t
            out = jax.lax.switch(j, branches, jax.lax.dynamic_slice_in_dim(xs, lo, t))
            # Rows past expert j's last are the next expert's (its tiles come later and
            # write them again) or the padding.
            return jax.lax.dynamic_update_slice_in_dim(ys, out, lo, 0)

        ys = jax.lax.fori_loop(0, jnp.sum(tiles), body, jnp.zeros((a + t, d), jnp.float32))
        ys = ys[:a] * w.reshape(-1)[order][:, None].astype(jnp.float32)
        return jnp.zeros((n, d), jnp.float32).at[token].add(ys).astype(x.dtype)

    def _grouped(self, x, w, ids):
        n, k = ids.shape
        e = self.gate_proj.shape[0]
        flat = ids.reshape(-1)
        order = jnp.argsort(flat)
        token = order // k
        sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
        xs = x[token].astype(self.gate_proj.dtype)
        hid = self.act(jax.lax.ragged_dot(xs, self.gate_proj[...], sizes),
                       jax.lax.ragged_dot(xs, self.up_proj[...], sizes))
        ys = jax.lax.ragged_dot(hid, self.down_proj[...], sizes).astype(jnp.float32)
        ys = ys * w.reshape(-1)[order][:, None]
        return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token].add(ys).astype(x.dtype)

    def _picked(self, x, w, ids):
        # One token at a time (lax.map): traced over all n·k assignments at once, XLA:CPU
        # merged the slices' products into batched ones it runs badly (E 16, k 2, d 512,
        # i 256, per layer at n 4: 5.6 ms, one token at a time 1.2 ms, dense 1.8 ms).
        k = ids.shape[1]

        def token(args):
            xt, wt, it = args
            xt = xt.astype(self.gate_proj.dtype)

            def one(a):
                g, u, d = (jax.lax.dynamic_index_in_dim(p[...], it[a], keepdims=False)
                           for p in (self.gate_proj, self.up_proj, self.down_proj))
                return self.act(xt @ g, xt @ u) @ d

            ys = jnp.stack([one(a) for a in range(k)]).astype(jnp.float32)
            return jnp.sum(ys * wt[:, None], axis=0).astype(x.dtype)

        if ids.shape[0] == 1:       # no loop for one token (0.18 vs 0.36 ms a layer)
            return token((x[0], w[0], ids[0]))[None]
        return jax.lax.map(token, (x, w, ids))

    def _dense(self, x, w, ids):
        n = x.shape[0]
        e = self.gate_proj.shape[0]
        comb = _combine(w, ids, e)
        # x broadcast over experts makes each product an expert-batched matmul over the
        # weights as stored ([e, d, f]: batch, contraction, free), so XLA copies none.
        xs = jnp.broadcast_to(x.astype(self.gate_proj.dtype), (e, *x.shape))
        hid = self.act(jnp.einsum("end,edf->enf", xs, self.gate_proj[...]),
                       jnp.einsum("end,edf->enf", xs, self.up_proj[...]))
        ys = jnp.einsum("enf,efd->end", hid, self.down_proj[...]).astype(jnp.float32)
        return jnp.einsum("end,ne->nd", ys, comb).astype(x.dtype)


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.gate = Router(cfg, rngs=rngs)
        self.experts = Experts(cfg, rngs=rngs)
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                   dtype=dtype_of(cfg), rngs=rngs)
                               if cfg.n_shared_experts else None)

    def __call__(self, x: jax.Array) -> jax.Array:
        with jax.named_scope("moe"):
            flat = x.reshape(-1, x.shape[-1])
            w, ids = self.gate(flat)
            y = self.experts(flat, w, ids).reshape(x.shape)
            if self.shared_experts is not None:
                y = y + self.shared_experts(x)
            return y


def unstack_experts(model: nnx.Module) -> int:
    """`Experts.unstack` every routed-expert block of `model` in place (the stacked
    arrays are dropped, so the weights are not held twice) → how many blocks changed.
    For a model on one XLA:CPU device (`jlco.engine.runner.ModelRunner` does this)."""
    changed = 0
    for _, node in nnx.iter_graph(model):
        if isinstance(node, Experts) and not node.per_expert:
            node.unstack()
            changed += 1
    return changed
