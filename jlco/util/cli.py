"""One-line error exits for the entry points and tools: bad input (a flag, a config
value, a checkpoint file) is reported as `PROG: error: MESSAGE` on stderr with a non-zero
exit code, never as a traceback. Exceptions not listed by the caller still propagate
with their traceback, because those are bugs, not bad input.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
from typing import Iterator, NoReturn

USAGE_EXIT = 2      # bad input: a flag, a file, a config value
FAILURE_EXIT = 1    # the input was fine but the result is unusable (e.g. non-finite output)


def fail(prog: str, message: str, code: int = USAGE_EXIT) -> NoReturn:
    """Print `prog: error: message` to stderr and exit with `code`."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def warn(prog: str, message: str) -> None:
    print(f"{prog}: warning: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def errors_exit(prog: str, *types: type[BaseException], code: int = USAGE_EXIT) -> Iterator[None]:
    """Turn the listed exception types raised in the block into `fail(prog, str(err))`."""
    try:
        yield
    except types as err:
        fail(prog, describe(err), code)


class Interrupted(BaseException):
    """SIGTERM or SIGINT arrived (raised by `interruptible`'s handler)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def interruptible(prog: str) -> Iterator[None]:
    """SIGTERM and SIGINT end the block like an exception, so `finally` blocks and
    finalizers run (a file-backed host pool deletes its file), then exit 128 + signal
    with one line on stderr instead of a traceback (SIGINT) or no cleanup at all
    (SIGTERM's default). Python runs the handler between bytecodes: a signal during a
    compile takes effect when the compile returns."""
    def on_signal(signum, frame):
        raise Interrupted(signum)
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    except Interrupted as err:
        for s, h in old.items():   # a second signal during cleanup: default behaviour
            signal.signal(s, h)
        fail(prog, f"interrupted by {signal.Signals(err.signum).name}; resources released",
             128 + err.signum)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run_main(main, **app_kw) -> NoReturn:
    """`absl.app.run(main)`, then exit at once with its exit code, once every `finally`
    and close() of the program has run (the engine's host pool is closed explicitly).
    Skipping interpreter shutdown keeps library background threads (Orbax's asyncio
    loops after a failed restore) from printing tracebacks after our one-line error."""
    import os
    from absl import app
    code = 0
    try:
        app.run(main, **app_kw)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def flags_parser(prog: str):
    """`app.run(main, flags_parser=...)` for a tool: absl's flag parsing with a one-line
    error instead of the usage text."""
    def parse(argv):
        from absl import flags
        try:
            return flags.FLAGS(argv)
        except flags.Error as err:
            fail(prog, str(err))
    return parse


def describe(err: BaseException) -> str:
    """The exception's message; OS errors without a useful str() get their type and
    file name, KeyError its bare key."""
    msg = str(err)
    if isinstance(err, OSError) and err.filename and str(err.filename) not in msg:
        msg = f"{msg}: {err.filename!r}"
    if not msg or isinstance(err, KeyError):
        msg = f"{type(err).__name__}: {msg or err!r}"
    return msg


def report_json(obj, indent: int | None = 1) -> str:
    """Strict JSON (no NaN/Infinity tokens, which other parsers reject) for reports whose
    statistics may be undefined (a rate over zero events): those become null."""
    def clean(v):
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        if isinstance(v, float) and not math.isfinite(v):
            return None
        return v
    return json.dumps(clean(obj), indent=indent, allow_nan=False)


def write_report(path, report, table: str, as_json: bool) -> None:
    """A tool's ending: the report as strict JSON written atomically to `path`, then the
    table on stdout, or with `as_json` the JSON on stdout and the table on stderr."""
    from jlco.util import atomic
    text = report_json(report)
    atomic.write_text(path, text + "\n")
    if as_json:
        print(table, file=sys.stderr)
        print(text)
    else:
        print(table)
