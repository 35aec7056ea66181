"""`python -m jlco.sim [--json] [--out DIR]`: fit the decode-throughput simulator of
`jlco.planning.throughput` on ESS's calibration rows and print its predictions (a table,
or the JSON with --json); DIR (default out/sim) receives sim.json and the PNG plots.

`--mesh data=D,expert=E` (`jlco.planning.mesh`; default ESS's data=1,expert=32) predicts
per device of that mesh: EP E sets the experts per GPU and the all-to-all's inter-node
share, and the KV budget is ESS's less the extra weight bytes of EP E. The fit always
runs on ESS's EP 32 rows; tensor > 1 is refused (the step model is TP 1).

Every prediction carries the indexer-cost band (`indexer_uncertainty`, and `band` on each
best point): the calibration rows are all at 32K.

`published_held_out` holds ESS's other Table 2 rows (MTP 4 at 32K, MTP 2 at 128K; never
fitted), each at its own batch and sparse memory ratio: target and predicted node
tokens/s, the error (`max_abs_held_out_error_pct` over all), the step's terms in ms, and
`fetch`: missed rows and bytes per step, hot-buffer hit rate, and the fetch stall per step
with overlap (ESS DA + DBA: behind resident attention and the other micro-batch's
indexer) and without (on-demand: the attention waits for the fetch). What the model
assumes and why: docs/facts.md §3 "What the table says about a step model".

An unknown --hardware, a bad --mesh or an unwritable --out is one `jlco.sim: error: ...`
line on stderr (exit 2), checked before the fit runs; files are written atomically.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from jlco.config import ModelConfig

from jlco.planning.hardware import HARDWARE, get_hardware
from jlco.planning.mesh import parse_mesh
from jlco.planning.sim_report import format_table, plot
from jlco.planning.throughput import ESS_MESH, kv_budget_for, run
from jlco.util import atomic, cli

PROG = "jlco.sim"


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    with cli.errors_exit(PROG, ValueError, OSError):
        mesh = _check_flags(f)
        out = run(f.hardware, mesh)
        if f.out:
            out["plots"] = plot(out, f.out)
            text = json.dumps(out, indent=1, allow_nan=False)
            atomic.write_text(os.path.join(f.out, "sim.json"), text + "\n")
        text = json.dumps(out, indent=1, allow_nan=False) if f.json else format_table(out)
    print(text)


def _check_flags(f):
    """Validate the flags before the fit; returns the mesh."""
    try:
        get_hardware(f.hardware)
    except ValueError:
        raise ValueError(f"--hardware={f.hardware!r} is invalid: allowed one of "
                         f"{', '.join(HARDWARE)} (case-insensitive)") from None
    mesh = ESS_MESH if f.mesh is None else parse_mesh(f.mesh)
    if mesh.tensor != 1:
        raise ValueError(f"--mesh={f.mesh!r} is invalid: tensor={mesh.tensor}, the simulator "
                         "models tensor=1 only (ESS runs TP 1)")
    kv_budget_for(ModelConfig(), mesh)
    if f.out:
        atomic.check_writable(f.out, "--out")
    return mesh


def define_flags() -> None:
    flags.DEFINE_string("hardware", "h200", "hardware profile key: " + ", ".join(HARDWARE))
    flags.DEFINE_string("mesh", None, "data=D,expert=E (tensor=1); default ESS's "
                        "data=1,expert=32")
    flags.DEFINE_bool("json", False, "print everything as JSON instead of the table")
    flags.DEFINE_string("out", "out/sim", "directory for sim.json and the PNG plots "
                        "('' = none)")


if __name__ == "__main__":
    define_flags()
    app.run(main)
