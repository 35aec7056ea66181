"""Beyond one device: the JAX mesh. `mesh` builds the ("data", "expert", "tensor") mesh
from the config's `mesh` section (`make_mesh`), holds the one table that maps the
model's logical parameter axes to mesh axes (`RULES`), places a model's parameters with
it (`shard_model`), checks at start-up what the mesh cannot run (`check_mesh`), and gives
the engine the shardings of replicated arrays under the active mesh (`replicated`).
`expert` is expert-parallel MoE: routed experts split over the "expert" axis, tokens
dispatched and combined with `jax.lax.all_to_all` inside `jax.shard_map`.
`distributed` joins several processes (hosts) into one device set with
`jax.distributed.initialize`, from the entry points' flags (`define_flags`) or the
environment, before any backend exists.

May import: jax, flax, numpy and `jlco.config` only (and absl for `distributed`'s
flags), so that `jlco.model` (the MoE block) can import it; nothing here imports the
model, the engine or the entry points.
This file imports nothing eagerly.
"""
