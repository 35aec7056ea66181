"""transformers' DeepseekV32 as the independent reference for parity tests.

The model builders and runs live in `jlco.checkpoint.hf_reference` (the tools need them
too, and tools do not import the tests); this module re-exports them with the tests'
own small torch helpers.
"""

from __future__ import annotations

import numpy as np
import torch

from jlco.checkpoint.hf_reference import (  # noqa: F401  (re-exported for the tests)
    build_hf_model,
    hf_config,
    hf_greedy_chunked,
    hf_tensors,
    layer0_index_scores64,
    long_context_model,
)


def capture(module: torch.nn.Module, store: dict, key: str):
    """Forward hook storing (args, kwargs, output) of `module` under store[key]."""
    def hook(_m, args, kwargs, output):
        store[key] = (args, kwargs, output)
    return module.register_forward_hook(hook, with_kwargs=True)


def t2n(x) -> np.ndarray:
    return x.detach().float().cpu().numpy()
