"""`python -m jlco.plan --config configs/128k.py --hardware h200 [--json]`: the memory
plan (largest batch with and without offload, host memory, transfer check) of
`jlco.planning.memory`, as a table or JSON."""

from __future__ import annotations

import json

from absl import app, flags

from jlco.config import load_config
from jlco.planning.hardware import get_hardware
from jlco.planning.memory import format_table, plan
from jlco.planning.params import WEIGHT_FORMATS


def main(argv) -> None:
    del argv
    f = flags.FLAGS
    cfg = load_config(f.config)
    p = plan(cfg, get_hardware(f.hardware), ep=f.ep, context=f.context, miss_rate=f.miss_rate,
             accept=f.accept, weight_format=f.weight_format,
             reserve_bytes=None if f.reserve_gb is None else f.reserve_gb * 1e9)
    print(json.dumps(p.as_dict(), indent=1) if f.json else format_table(p))


def define_flags() -> None:
    flags.DEFINE_string("config", None, "python config file (configs/*.py)", required=True)
    flags.DEFINE_string("hardware", "h200", "hardware profile key (jlco.planning.hardware.HARDWARE)")
    flags.DEFINE_integer("ep", 32, "expert-parallel ranks the routed experts are split over "
                         "(ESS: 32)")
    flags.DEFINE_integer("context", None, "tokens per request (default engine.max_context_len)")
    flags.DEFINE_float("miss_rate", None, "fraction of top-k lookups that miss (default: "
                       "ESS locality profile)")
    flags.DEFINE_float("accept", None, "mean accepted tokens per step (default 1 + 0.35 x drafts)")
    flags.DEFINE_enum("weight_format", "fp8", list(WEIGHT_FORMATS), "weight storage")
    flags.DEFINE_float("reserve_gb", None, "runtime reserve (default: hardware profile)")
    flags.DEFINE_bool("json", False, "print JSON instead of the table")


if __name__ == "__main__":
    define_flags()
    app.run(main)
