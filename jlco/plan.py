"""`python -m jlco.plan --config configs/128k.py --hardware h200 [--json]`: the memory
plan (largest batch with and without offload, host memory, transfer check) of
`jlco.planning.memory`, as a table or JSON. A config file that defines a DeepSeek-V4
`DEPLOYMENT` (configs/deepseek_v4_flash.py, configs/deepseek_v4_pro.py) gets
`jlco.planning.v4`'s plan: cache bytes per request per layer type, largest batches.

`--mesh data=D,expert=E,tensor=T` plans one device of that mesh (`jlco.planning.mesh`:
the axes multiply, attention is data-parallel over data × expert, routed experts split
over expert, head / FFN / vocabulary matmuls over tensor); memory is per device, the host
pool per host of `--devices_per_host` devices. Default mesh: the config's `mesh` section
if it declares more than one device, else data=1,expert=--ep,tensor=1 (--ep keeps its
meaning and default 32; an explicit --ep beats the config's mesh). --ep together with
--mesh is refused (exit 2): the expert degree has one home.

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
from jlco.planning.mesh import MeshShape, config_mesh, parse_mesh
from jlco.planning import v4
from jlco.planning.params import WEIGHT_FORMATS
from jlco.util import cli

PROG = "jlco.plan"


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    with cli.errors_exit(PROG, ConfigError, ValueError, OSError):
        dep = v4.load_deployment(f.config)
        if dep is not None:
            print(_plan_v4(dep, f))
            return
        fmt = f.weight_format or "fp8"
        if fmt not in WEIGHT_FORMATS:
            raise ValueError(f"--weight_format={fmt}: allowed one of "
                             + ", ".join(WEIGHT_FORMATS))
        cfg = load_config(f.config)
        hw = _hardware(f.hardware)
        mesh = choose_mesh(f.mesh, f.ep, f["ep"].present, cfg)
        p = plan(cfg, hw, mesh=mesh, devices_per_host=f.devices_per_host, context=f.context,
                 miss_rate=f.miss_rate, accept=f.accept, weight_format=fmt,
                 reserve_bytes=None if f.reserve_gb is None else f.reserve_gb * 1e9)
        text = json.dumps(p.as_dict(), indent=1, allow_nan=False) if f.json else format_table(p)
    print(text)


def _plan_v4(dep, f) -> str:
    """A deepseek_v4 deployment (`DEPLOYMENT` in the config file): `jlco.planning.v4`."""
    fmt = f.weight_format or "official"
    if fmt not in v4.V4_WEIGHT_FORMATS:
        raise ValueError(f"--weight_format={fmt} for deepseek_v4: allowed one of "
                         + ", ".join(v4.V4_WEIGHT_FORMATS))
    for name in ("miss_rate", "accept"):
        if f[name].present:
            raise ValueError(f"--{name} with a deepseek_v4 deployment: not modelled (the "
                             "V4 plan has no transfer check yet)")
    mesh = choose_mesh(f.mesh, f.ep, f["ep"].present, None)   # a deployment has no mesh section
    p = v4.plan(dep, _hardware(f.hardware), mesh=mesh, context=f.context,
                weight_format=fmt, devices_per_host=f.devices_per_host,
                reserve_bytes=None if f.reserve_gb is None else f.reserve_gb * 1e9)
    return json.dumps(p.as_dict(), indent=1, allow_nan=False) if f.json else v4.format_table(p)


def choose_mesh(text: str | None, ep: int, ep_given: bool, cfg) -> MeshShape:
    """--mesh, else an explicit --ep, else the config's mesh, else --ep's default."""
    if text is not None:
        if ep_given:
            raise ValueError(f"--ep={ep} with --mesh={text!r}: give the expert degree once, "
                             "as --mesh ...,expert=E")
        return parse_mesh(text)
    from_cfg = None if ep_given else config_mesh(cfg)
    return from_cfg or MeshShape(1, ep, 1)


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
                         "(ESS: 32); means --mesh data=1,expert=EP; not with --mesh",
                         lower_bound=1)
    flags.DEFINE_string("mesh", None, "data=D,expert=E,tensor=T (axes left out are 1; "
                        "default: the config's mesh, else data=1,expert=--ep)")
    flags.DEFINE_integer("devices_per_host", 8, "devices per host: the host pool is per host",
                         lower_bound=1)
    flags.DEFINE_integer("context", None, "tokens per request (default engine.max_context_len)",
                         lower_bound=1)
    flags.DEFINE_float("miss_rate", None, "fraction of top-k lookups that miss (default: "
                       "ESS locality profile)", lower_bound=0.0, upper_bound=1.0)
    flags.DEFINE_float("accept", None, "mean accepted tokens per step (default 1 + 0.35 x "
                       "drafts)", lower_bound=1.0)
    flags.DEFINE_string("weight_format", None, "weight storage: " + ", ".join(WEIGHT_FORMATS)
                        + " (default fp8); deepseek_v4: " + ", ".join(v4.V4_WEIGHT_FORMATS)
                        + " (default official: FP4 experts, FP8 matrices)")
    flags.DEFINE_float("reserve_gb", None, "runtime reserve (default: hardware profile)",
                       lower_bound=0.0)
    flags.DEFINE_bool("json", False, "print JSON instead of the table")


if __name__ == "__main__":
    define_flags()
    app.run(main)
