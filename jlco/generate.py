"""`python -m jlco.generate`: generate tokens for one prompt.

With --checkpoint (a Hugging Face directory or a jlco Orbax directory from
`python -m jlco.convert`) it loads the real weights; without one it builds a small
random-weight model from --config (configs/tiny.py) and says so on stderr.
--offload puts the MLA latent cache in host memory (same tokens as without it).
"""

from __future__ import annotations

import json
import pathlib
import sys

from absl import app, flags, logging

FLAGS = flags.FLAGS
_ROOT = pathlib.Path(__file__).resolve().parent.parent


def define_flags() -> None:
    """Flags are defined only when this module runs as a program, so importing it
    (tests, other tools) never collides with another CLI's flag names."""
    flags.DEFINE_string("checkpoint", None, "HF or Orbax checkpoint directory (none: random tiny model)")
    flags.DEFINE_string("config", None, "config file for the cache/engine sections (and the model "
                        "when no checkpoint is given); default configs/tiny.py")
    flags.DEFINE_string("prompt_ids", None, "comma-separated prompt token ids, e.g. 1,2,3")
    flags.DEFINE_string("prompt", None, "prompt text (needs a checkpoint with tokenizer.json)")
    flags.DEFINE_integer("max_new_tokens", 16, "tokens to generate")
    flags.DEFINE_float("temperature", 0.0, "sampling temperature; 0 = greedy")
    flags.DEFINE_integer("seed", 0, "random seed (sampling, and the random model's weights)")
    flags.DEFINE_bool("offload", None, "latent cache in host memory (default: the config's value)")
    flags.DEFINE_enum("impl", None, ["auto", "xla", "pallas"], "attention kernels (default: config)")
    flags.DEFINE_integer("num_draft_tokens", 0, "MTP draft tokens per step (needs an MTP layer)")
    flags.DEFINE_bool("json", False, "print {\"tokens\": [...], \"logprobs\": [...]}")


def _fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def _load(cfg_path: str | None):
    """(Config, model, tokenizer path or None)."""
    from flax import nnx

    from jlco.config import load_config
    from jlco.model.decoder import DeepseekV32
    base = load_config(cfg_path or _ROOT / "configs" / "tiny.py")
    if FLAGS.checkpoint is None:
        print(f"no --checkpoint: using a small RANDOM-WEIGHT model ({base.name} config, "
              f"seed {FLAGS.seed}); outputs are meaningless tokens", file=sys.stderr)
        return base, DeepseekV32(base.model, rngs=nnx.Rngs(FLAGS.seed)), None
    from jlco.checkpoint.load import load_model
    mcfg, model, info = load_model(FLAGS.checkpoint)
    if FLAGS.num_draft_tokens and not info["has_mtp"]:
        _fail(f"--num_draft_tokens={FLAGS.num_draft_tokens}: MTP is unavailable, checkpoint "
              f"{FLAGS.checkpoint} has no MTP layer (model.layers.{mcfg.num_hidden_layers}.*); "
              "checkpoints saved by transformers carry none")
    cfg = base.replace(model=mcfg, name=pathlib.Path(FLAGS.checkpoint).name)
    return cfg, model, info.get("tokenizer_path")


def _prompt(tokenizer_path) -> list[int]:
    if (FLAGS.prompt_ids is None) == (FLAGS.prompt is None):
        _fail("give exactly one of --prompt_ids or --prompt")
    if FLAGS.prompt is not None:
        if tokenizer_path is None:
            _fail("--prompt needs a checkpoint with tokenizer.json; use --prompt_ids")
        from tokenizers import Tokenizer
        return Tokenizer.from_file(str(tokenizer_path)).encode(FLAGS.prompt).ids
    try:
        return [int(t) for t in FLAGS.prompt_ids.split(",") if t.strip()]
    except ValueError:
        _fail(f"--prompt_ids={FLAGS.prompt_ids!r}: expected comma-separated integers")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    from jlco.config import ConfigError
    from jlco.engine.core import Engine, RequestError
    try:
        cfg, model, tok_path = _load(FLAGS.config)
        prompt = _prompt(tok_path)
        offload = cfg.cache.offload if FLAGS.offload is None else FLAGS.offload
        need = len(prompt) + FLAGS.max_new_tokens
        cfg = cfg.replace(cache__offload=offload, engine__max_batch_size=1,
                          engine__num_draft_tokens=FLAGS.num_draft_tokens,
                          engine__max_context_len=max(need, cfg.engine.max_context_len),
                          **({"engine__attention_impl": FLAGS.impl} if FLAGS.impl else {}))
        engine = Engine(cfg, model)
        req = engine.submit(prompt, FLAGS.max_new_tokens, FLAGS.temperature, FLAGS.seed)
        engine.run()
    except (ConfigError, RequestError, ValueError) as e:
        _fail(str(e))
    if FLAGS.json:
        print(json.dumps({"tokens": req.tokens, "logprobs": req.logprobs}))
    else:
        print(" ".join(map(str, req.tokens)))
    if engine.spec_metrics is not None:
        m = engine.spec_metrics
        print(f"speculative: {FLAGS.num_draft_tokens} drafts/step, {m.steps} steps, "
              f"drafted {m.drafted}, accepted {m.accepted} (acceptance "
              f"{m.acceptance_rate:.3f}), {m.mean_accepted_tokens:.2f} tokens/step",
              file=sys.stderr)
    if engine.metrics is not None:
        snap = engine.metrics.snapshot()["total"]
        print(f"offload: hit rate {snap['hit_rate']:.3f}, H2D {snap['h2d_bytes']} B, "
              f"warm-up rows {engine.runner.warmup_rows}", file=sys.stderr)


if __name__ == "__main__":
    define_flags()
    app.run(main)
