"""tests/support/composition.py's runs with the host-driven scheduling knobs on
(`cache.split_attention`, `cache.prefetch_ahead`), for tests/engine/
test_prefetch_compose.py. Run as `python -m tests.support.knob_composition '<json list
of [mesh, drafts, async, knobs]>'` in a process with 2 forced CPU devices; prints one
JSON line per run (composition.run's fields)."""

from __future__ import annotations

import json
import sys

from tests.support import composition

KNOBS = {"split": {"cache__split_attention": True},
         "prefetch": {"cache__prefetch_ahead": True},
         "both": {"cache__split_attention": True, "cache__prefetch_ahead": True}}


def main(argv) -> None:
    real = composition.config
    for mesh, drafts, async_on, knobs in json.loads(argv[1]):
        def config(*combo, _knobs=knobs):
            return real(*combo).replace(**KNOBS[_knobs])
        composition.config = config
        try:
            out = composition.run((mesh, drafts, "host_driven", async_on))
        finally:
            composition.config = real
        print(json.dumps(dict(out, knobs=knobs)), flush=True)


if __name__ == "__main__":
    main(sys.argv)
