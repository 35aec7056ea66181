"""Planning: per-unit parameter counts and weight bytes (`params`), the memory planner
(`memory`: largest batch with and without offload, host memory, transfer check), the
decode-throughput simulator fitted on ESS's rows (`throughput`), hardware profiles with
sources (`hardware`), top-k trace files with their replay and MTP-union measurement
(`trace`), the decode step's roofline (`roofline`: bytes and FLOPs a step must touch,
against a machine), the (data, expert, tensor) mesh a plan is per device of (`mesh`),
and the hot rows an MTP step's top-k union needs (`mtp`).

May import: numpy, `jlco.config`, `jlco.model.kv_cache` (cache shapes), `jlco.util`
(atomic writes). Never the engine: the engine writes traces through `trace`, and the
planner-vs-engine check lives in tests.
Inside the wing: params, mesh, mtp, roofline <- throughput <- memory (no cycle).
"""
