"""jlco: DeepSeek-V3.2 (MLA + DeepSeek Sparse Attention) decode with the MLA latent cache
in host memory. See README.md (layout, commands) and docs/ (design, facts).

Wings, each a package with its own docstring saying what it may import:
`config` (the validated config tree), `pallas/` (kernels + references), `offload/`
(host pool, pages, hot buffer, fetch), `model/` (Flax NNX model, device cache, prefill),
`checkpoint/` (HF and Orbax), `engine/` (scheduler, runner, engine), `planning/`
(memory planner, throughput simulator, hardware, traces, roofline), `util/` (atomic
writes, one-line CLI errors, the compilation cache). The modules at this level are
thin absl entry points: `python -m jlco.generate | convert | plan | sim`.
"""

__version__ = "0.1.0"
