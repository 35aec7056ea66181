"""`python -m jlco.plan --config configs/128k.py --hardware h200 [--json]`: the memory
plan (largest batch with and without offload, host memory, transfer check) of
`jlco.planning.memory`, as a table or JSON.

Bad flags are one line on stderr and a non-zero exit, no traceback: numeric ranges
through absl's bounds (exit 1, at parse time), an unknown --hardware or a bad --config
as `jlco.plan: error: ...` (exit 2).
"""

from __future__ import annotations

import json

from absl import app, flags

from jlco.config import ConfigError, load_config
from jlco.planning.hardware import HARDWARE, get_hardware
from jlco.planning.memory import format_table, plan
from jlco.planning.params import WEIGHT_FORMATS
from jlco.util import cli

PROG = "jlco.plan"


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    with cli.errors_exit(PROG, ConfigError, ValueError, OSError):
        cfg = load_config(f.config)
        hw = _hardware(f.hardware)
        p = plan(cfg, hw, ep=f.ep, context=f.context, miss_rate=f.miss_rate,
                 accept=f.accept, weight_format=f.weight_format,
                 reserve_bytes=None if f.reserve_gb is None else f.reserve_gb * 1e9)
        text = json.dumps(p.as_dict(), indent=1, allow_nan=False) if f.json else format_table(p)
    print(text)


def _hardware(name: str):
    try:
        return get_hardware(name)
    except ValueError:
        raise ValueError(f"--hardware={name!r} is invalid: allowed one of "
                         f"{', '.join(HARDWARE)} (case-insensitive)") from None


def define_flags() -> None:
    flags.DEFINE_string("config", None, "python config file (configs/*.py)", required=True)
    flags.DEFINE_string("hardware", "h200", "hardware profile key: " + ", ".join(HARDWARE))
    flags.DEFINE_integer("ep", 32, "expert-parallel ranks the routed experts are split over "
                         "(ESS: 32)", lower_bound=1)
    flags.DEFINE_integer("context", None, "tokens per request (default engine.max_context_len)",
                         lower_bound=1)
    flags.DEFINE_float("miss_rate", None, "fraction of top-k lookups that miss (default: "
                       "ESS locality profile)", lower_bound=0.0, upper_bound=1.0)
    flags.DEFINE_float("accept", None, "mean accepted tokens per step (default 1 + 0.35 x "
                       "drafts)", lower_bound=1.0)
    flags.DEFINE_enum("weight_format", "fp8", list(WEIGHT_FORMATS), "weight storage")
    flags.DEFINE_float("reserve_gb", None, "runtime reserve (default: hardware profile)",
                       lower_bound=0.0)
    flags.DEFINE_bool("json", False, "print JSON instead of the table")


if __name__ == "__main__":
    define_flags()
    app.run(main)
