"""The engine tests' shared workload: the tiny config on 2 slots and 4 requests of
different prompt and generation lengths, so later requests join when earlier ones leave
(slots and pages reused mid-run) and prompts longer than index_topk make the indexer select."""

import numpy as np
from flax import nnx

from jlco.config import load_config
from jlco.engine.core import Engine
from jlco.model.decoder import DeepseekV32

BASE = load_config("configs/tiny.py").replace(
    engine__attention_impl="xla", engine__max_batch_size=2, engine__max_context_len=160)
PROMPT_LENS, NEW_TOKENS = (5, 70, 40, 90), (9, 4, 7, 6)


def make_model(cfg=BASE, seed=0):
    return DeepseekV32(cfg.model, rngs=nnx.Rngs(seed))


def make_prompts(lens=PROMPT_LENS, seed=1):
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(0, BASE.model.vocab_size, n))) for n in lens]


def run_workload(cfg, model, prompts, new_tokens=NEW_TOKENS, **engine_kw):
    """Run every request to the end; assert each finished and that every slot and page
    came back. → (engine, [(tokens, logprobs) per request])."""
    eng = Engine(cfg, model, **engine_kw)
    reqs = [eng.submit(p, n) for p, n in zip(prompts, new_tokens)]
    eng.run()
    assert all(r.status == "finished" for r in reqs)
    eng.check_no_leaks()
    assert eng.scheduler.slots == [None] * cfg.engine.max_batch_size
    if eng.scheduler.pages is not None:
        assert eng.scheduler.pages.used_pages == 0
    return eng, [(r.tokens, r.logprobs) for r in reqs]


def assert_forward_equal(off, on, prompts):
    """Admit the same requests into two engines, then three verification passes of 2
    tokens per slot: logits [batch, s, V] f32, offload on == offload off bit for bit."""
    import chex
    for eng in (off, on):
        for p in prompts:
            eng.submit(p, 8)
        eng.admit()
    active = [r is not None for r in on.scheduler.slots]
    rng = np.random.default_rng(2)
    for _ in range(3):
        toks = rng.integers(0, BASE.model.vocab_size, (2, 2))
        want, got = off.runner.forward(toks, active), on.runner.forward(toks, active)
        chex.assert_shape(got, (2, 2, BASE.model.vocab_size))
        chex.assert_type(got, np.float32)
        chex.assert_trees_all_equal(got, want)
