"""`python -m jlco.sim [--json] [--out DIR]`: fit the decode-throughput simulator of
`jlco.planning.throughput` on ESS's calibration rows and print its predictions (a table,
or the JSON with --json); DIR (default out/sim) receives sim.json and the PNG plots.

An unknown --hardware or an unwritable --out is one `jlco.sim: error: ...` line on
stderr (exit 2), checked before the fit runs; files are written atomically.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from jlco.planning.hardware import HARDWARE, get_hardware
from jlco.planning.throughput import format_table, plot, run
from jlco.util import atomic, cli

PROG = "jlco.sim"


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    with cli.errors_exit(PROG, ValueError, OSError):
        _check_flags(f)
        out = run(f.hardware)
        if f.out:
            out["plots"] = plot(out, f.out)
            text = json.dumps(out, indent=1, allow_nan=False)
            atomic.write_text(os.path.join(f.out, "sim.json"), text + "\n")
        text = json.dumps(out, indent=1, allow_nan=False) if f.json else format_table(out)
    print(text)


def _check_flags(f) -> None:
    try:
        get_hardware(f.hardware)
    except ValueError:
        raise ValueError(f"--hardware={f.hardware!r} is invalid: allowed one of "
                         f"{', '.join(HARDWARE)} (case-insensitive)") from None
    if f.out:
        atomic.check_writable(f.out, "--out")


def define_flags() -> None:
    flags.DEFINE_string("hardware", "h200", "hardware profile key: " + ", ".join(HARDWARE))
    flags.DEFINE_bool("json", False, "print everything as JSON instead of the table")
    flags.DEFINE_string("out", "out/sim", "directory for sim.json and the PNG plots "
                        "('' = none)")


if __name__ == "__main__":
    define_flags()
    app.run(main)
