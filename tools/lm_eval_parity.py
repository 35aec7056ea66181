"""lm-eval's loglikelihood and multiple-choice tasks through `jlco.serve`, against lm-eval's
own `hf` backend on the same checkpoint.

Builds (under --out) a tiny random DeepSeek-V3.2 checkpoint in Hugging Face format (float32,
the tiny config's shapes) with a byte-level BPE `tokenizer.json`, two local tasks over a
generated corpus (no hub access: `dataset_path: json`), then runs lm-eval twice:
`--model hf` (transformers' DeepseekV32ForCausalLM) and `--model local-completions`
against a `python -m jlco.serve --checkpoint` started here (`echo` + `logprobs`, prompts
sent as token-id lists, --batch_size prompts per request). Per sample: the
log-likelihood of each choice / continuation from both, their largest difference, and
whether every accuracy agrees (other metrics within 1e-5 relative). Needs `pip install lm_eval` (not a jlco dependency).

  python tools/lm_eval_parity.py --num_docs 40 --batch_size 4

Results: --out/lm_eval_parity.json, a table on stdout; exit 1 when a log-likelihood differs
by more than --tolerance or an accuracy differs.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
REPO = pathlib.Path(__file__).resolve().parents[1]
WORDS = ("the quick brown fox jumps over lazy dog red blue green sun moon star river hill "
         "tree stone bird fish cat runs sleeps sings eats sees finds big small old new").split()


def define_flags() -> None:
    flags.DEFINE_string("out", None, "work directory (default: out/lm_eval_parity)")
    flags.DEFINE_integer("num_docs", 40, "documents per task")
    flags.DEFINE_integer("batch_size", 4, "lm-eval --batch_size (prompts per request)")
    flags.DEFINE_integer("seed", 0, "corpus and model seed")
    flags.DEFINE_float("tolerance", 1e-3, "largest allowed |log-likelihood difference|")
    flags.DEFINE_float("server_timeout_s", 900.0, "seconds the server gets to be ready")


def _sentence(rng, n: int) -> str:
    return " ".join(rng.choice(WORDS, n))


def build_checkpoint(path: pathlib.Path, seed: int) -> None:
    """HF-format tiny model (config.json, model.safetensors) + tokenizer files."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from jlco.checkpoint.hf_reference import build_hf_model
    from jlco.config import load_config
    model = build_hf_model(load_config(REPO / "configs" / "tiny.py").model, seed=seed,
                           init_std=0.1)
    model.save_pretrained(path)
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "model_max_length": 512}))


def build_tasks(path: pathlib.Path, n: int, seed: int) -> list[str]:
    """A multiple-choice task (4 choices) and a continuation task, as lm-eval YAML over
    local JSON lines."""
    rng = np.random.default_rng(seed)
    mc = [dict(question=_sentence(rng, int(rng.integers(4, 12))),
               choices=[_sentence(rng, int(rng.integers(1, 4))) for _ in range(4)],
               label=int(rng.integers(0, 4))) for _ in range(n)]
    ll = [dict(context=_sentence(rng, int(rng.integers(5, 30))),
               continuation=" " + _sentence(rng, int(rng.integers(1, 5)))) for _ in range(n)]
    for name, rows in (("mc", mc), ("ll", ll)):
        (path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "jlco_mc.yaml").write_text(f"""task: jlco_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
""")
    (path / "jlco_ll.yaml").write_text(f"""task: jlco_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path / 'll.jsonl'}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: acc
  - metric: perplexity
""")
    return ["jlco_mc", "jlco_ll"]


def run_lm_eval(model: str, model_args: dict, tasks: list[str], include: pathlib.Path) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager
    res = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks,
                                  batch_size=FLAGS.batch_size, log_samples=True,
                                  task_manager=TaskManager(include_path=str(include)))
    out = {}
    for task in tasks:
        samples = res["samples"][task]
        out[task] = dict(
            metrics={k: v for k, v in res["results"][task].items()
                     if isinstance(v, (int, float)) and "stderr" not in k},
            # per sample, per choice / continuation: (log-likelihood, is_greedy)
            loglik=[[float(r[0]) for r in s["filtered_resps"]] for s in samples])
    return out


def _same(a: dict, b: dict) -> bool:
    """Accuracies equal exactly; other metrics (perplexity: exp of a mean) within 1e-5."""
    if set(a) != set(b):
        return False
    return all(a[k] == b[k] if k.startswith("acc") else
               abs(a[k] - b[k]) <= 1e-5 * max(abs(a[k]), 1.0) for k in a)


def compare(hf: dict, served: dict) -> dict:
    out = {}
    for task in hf:
        a = np.array(sum(hf[task]["loglik"], []))
        b = np.array(sum(served[task]["loglik"], []))
        out[task] = dict(samples=len(a), max_abs_diff=float(np.abs(a - b).max()),
                         hf=hf[task]["metrics"], jlco=served[task]["metrics"],
                         metrics_equal=_same(hf[task]["metrics"], served[task]["metrics"]))
    return out


def main(argv) -> int:
    del argv
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from jlco.ops import loadgen
    out = pathlib.Path(FLAGS.out).expanduser() if FLAGS.out else REPO / "out" / "lm_eval_parity"
    ck, tasks_dir = out / "checkpoint", out / "tasks"
    ck.mkdir(parents=True, exist_ok=True)
    tasks_dir.mkdir(parents=True, exist_ok=True)
    build_checkpoint(ck, FLAGS.seed)
    tasks = build_tasks(tasks_dir, FLAGS.num_docs, FLAGS.seed)
    hf = run_lm_eval("hf", dict(pretrained=str(ck), dtype="float32", device="cpu"), tasks,
                     tasks_dir)
    args = loadgen.serve_args(config="configs/tiny.py", checkpoint=str(ck))
    srv = loadgen.start_serve("jlco", lambda *_: args, out / "server.log",
                              FLAGS.server_timeout_s, prog="lm_eval_parity")
    try:
        served = run_lm_eval("local-completions", dict(
            base_url=f"{srv.url}/v1/completions", model=ck.name, tokenizer=str(ck),
            tokenizer_backend="huggingface", tokenized_requests=True, num_concurrent=1,
            max_retries=1), tasks, tasks_dir)
    finally:
        srv.stop()
    cmp = compare(hf, served)
    (out / "lm_eval_parity.json").write_text(json.dumps(dict(
        flags=dict(num_docs=FLAGS.num_docs, batch_size=FLAGS.batch_size, seed=FLAGS.seed),
        comparison=cmp, hf=hf, jlco=served), indent=1))
    ok = True
    print("task | samples | max |dloglik| | hf | jlco")
    for task, c in cmp.items():
        print(f"{task} | {c['samples']} | {c['max_abs_diff']:.2e} | {c['hf']} | {c['jlco']}")
        ok &= c["max_abs_diff"] <= FLAGS.tolerance and c["metrics_equal"]
    print(f"within {FLAGS.tolerance} and equal metrics: {ok}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    define_flags()
    app.run(main)
