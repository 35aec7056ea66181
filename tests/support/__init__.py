"""Helpers shared by tests in several folders: the engine tests' workload
(`engine_workload`), the transformers reference model (`hf_reference`), the decode step
split into its parts (`split_steps`), entry points run as subprocesses with their error
checks and the tiny HF checkpoint (`cli`), a real `jlco.serve` on loopback (`server`), and
tools/make_fp8_checkpoint.py loaded as a module (`checkpoint`)."""
