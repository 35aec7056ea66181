"""Start-up of the programs that run a model (`jlco.generate`, `jlco.serve`): which model
runs (a checkpoint's, or a small random-weight one sized with the planner's weight
figure), the mesh it runs on, checked before any weight is read, and its weights loaded
straight into that mesh's shards (`load`). One sequence, so both programs run the same
model on the same devices for the same flags.

May import: `jlco.checkpoint` (reading configs and weights), `jlco.parallel` (the mesh
and its shardings), `jlco.planning` (weight bytes) and `jlco.config`;
never the engine or the server, which run what this hands them.
"""
