"""configs/glm5.py's GLM-5 with IndexShare: most layers reuse the top-k of the last full
layer before them, so they hold no indexer weights and cache no indexer keys.

The pattern is transformers' GlmMoeDsaConfig schedule with `index_topk_freq` 4 and
`index_skip_topk_offset` 2 (layer i full iff max(i - 1, 0) % 4 == 0: layers 0, 1, 5, 9,
..., 77, 21 of 78). It illustrates the planner; GLM-5.2's own config.json is not checked
here (a checkpoint's pattern is read from its config.json).

  python -m jlco.plan --config configs/glm5_index_share.py --hardware h200
"""
import dataclasses
import pathlib

from jlco.config import load_config

FREQ, OFFSET = 4, 2
_BASE = load_config(pathlib.Path(__file__).with_name("glm5.py"))
_TYPES = tuple("full" if max(i - OFFSET + 1, 0) % FREQ == 0 else "shared"
               for i in range(_BASE.model.num_hidden_layers))

CONFIG = dataclasses.replace(
    _BASE, name="glm5_index_share",
    model=dataclasses.replace(_BASE.model, indexer_types=_TYPES))
