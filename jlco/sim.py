"""`python -m jlco.sim [--json] [--plot_dir DIR]`: fit the decode-throughput simulator of
`jlco.planning.throughput` on ESS's calibration rows and print its predictions."""

from __future__ import annotations

import json

from absl import app, flags

from jlco.planning.throughput import format_table, plot, run


def main(argv) -> None:
    del argv
    f = flags.FLAGS
    out = run(f.hardware)
    if f.plot_dir:
        out["plots"] = plot(out, f.plot_dir)
    print(json.dumps(out, indent=1) if f.json else format_table(out))


def define_flags() -> None:
    flags.DEFINE_string("hardware", "h200", "hardware profile key (jlco.planning.hardware.HARDWARE)")
    flags.DEFINE_bool("json", False, "print everything as JSON instead of the table")
    flags.DEFINE_string("plot_dir", "", "write PNG plots here (beside the JSON)")


if __name__ == "__main__":
    define_flags()
    app.run(main)
