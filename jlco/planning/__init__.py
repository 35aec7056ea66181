"""Planning: per-unit parameter counts and weight bytes (`params`), the memory planner
(`memory`: largest batch with and without offload, host memory, transfer check), the
decode-throughput simulator fitted on ESS's rows (`throughput`), hardware profiles with
sources (`hardware`), top-k trace files with their replay (`trace`), and the decode
step's roofline (`roofline`: bytes and FLOPs a step must touch, against a machine).

May import: numpy, `jlco.config`, `jlco.model.kv_cache` (cache shapes). Never the engine:
the engine writes traces through `trace`, and the planner-vs-engine check lives in tests.
Inside the wing: params <- throughput <- memory (no cycle).
"""
