"""The decode step's options in combination (tests/engine/test_composition.py): the engine
workload (tests/support/engine_workload.py: 2 slots, 4 greedy requests joining as others
leave, prompts longer than index_topk) once per combination of mesh × drafts × fetch path
× async scheduling, on the tiny f32 model with its MTP layer.

Run as `python -m tests.support.composition '<json list of combinations>'` in a process
with 2 forced CPU devices (jax fixes the device count at start-up); prints one JSON line
per combination: its tokens, log-probs, the step kind the engine reports and whether
every slot and page came back.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import sys

MESHES = {"one": {}, "expert2": {"mesh__expert": 2}, "data2": {"mesh__data": 2}}
FETCHES = {"off": {"cache__offload": False},
           "in_jit": {"cache__offload": True},
           "host_driven": {"cache__offload": True, "cache__fetch_path": "host_driven"}}
DRAFTS = (0, 1, 2)
ASYNC = (True, False)
REFERENCE = ("one", 0, "off", False)

# A pairwise-covering subset of the full matrix (an L9 orthogonal array over the four
# factors, async's third level folded onto "on"): every pair of levels of any two
# factors appears in some row (checked by the default tier). The slow tier runs it on
# the f32 and the bf16 model; the exhaustive tier runs all 54 (tests/engine/test_composition.py).
PAIRWISE = tuple((m, d, f, a) for m, d, f, a in (
    ("one", 0, "off", True), ("one", 1, "in_jit", False), ("one", 2, "host_driven", True),
    ("expert2", 0, "in_jit", True), ("expert2", 1, "host_driven", True),
    ("expert2", 2, "off", False),
    ("data2", 0, "host_driven", False), ("data2", 1, "off", True),
    ("data2", 2, "in_jit", True)))
FULL = tuple(itertools.product(MESHES, DRAFTS, FETCHES, ASYNC))


def config(mesh: str, drafts: int, fetch: str, async_on: bool, dtype: str = "float32"):
    import dataclasses

    from tests.support.engine_workload import BASE
    return BASE.replace(model=dataclasses.replace(BASE.model, dtype=dtype),
                        engine__num_draft_tokens=drafts, engine__async_scheduling=async_on,
                        **MESHES[mesh], **FETCHES[fetch])


def run(combo) -> dict:
    import jax
    from jlco.engine.core import Engine
    from jlco.parallel.mesh import check_mesh, make_mesh, shard_model
    from tests.support.engine_workload import NEW_TOKENS, make_model, make_prompts

    cfg = config(*combo)
    model = make_model(cfg)
    mesh = None
    if cfg.mesh.num_devices > 1:
        check_mesh(cfg)
        mesh = make_mesh(cfg, jax.devices()[:cfg.mesh.num_devices])
        shard_model(model, mesh)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        eng = Engine(cfg, model)
        reqs = [eng.submit(p, n) for p, n in zip(make_prompts(), NEW_TOKENS)]
        eng.run()
        eng.check_no_leaks()
        pages = eng.scheduler.pages
        out = dict(combo=list(combo), tokens=[r.tokens for r in reqs],
                   logprobs=[r.logprobs for r in reqs], status=[r.status for r in reqs],
                   kind=eng.step_kind.describe(), follow=eng.step_kind.follow,
                   pages_left=0 if pages is None else pages.used_pages,
                   accepted=0 if eng.spec_metrics is None else eng.spec_metrics.accepted)
        eng.close()
    return out


def main(argv) -> None:
    for combo in json.loads(argv[1]):
        print(json.dumps(run(tuple(combo))), flush=True)


if __name__ == "__main__":
    main(sys.argv)
