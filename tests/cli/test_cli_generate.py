"""`python -m jlco.generate` end to end, as a user runs it:

- a float32 checkpoint saved by transformers computes in float32 (its config.json
  `dtype`) and equals transformers' greedy tokens and log-probs within 1e-4; its
  max_position_embeddings (256) is below configs/tiny.py's context (512), so the engine's
  context must follow the request; the prompts come from --prompts_file (token ids and
  text through the checkpoint's tokenizer.json) and decode as one batch;
- --dtype overrides the checkpoint's dtype (bfloat16 then differs from the f32 reference
  by more than rounding noise, which is the bug a silent bf16 load had), and the
  persistent compilation cache makes a second identical run compile much less;
- --config configs/128k.py without a checkpoint builds the small random model with the
  128K context and offload, under 4 GB RSS.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from tests.support.cli import make_hf_checkpoint, run

pytestmark = pytest.mark.e2e   # real subprocesses: the e2e tier (pyproject.toml)

torch = pytest.importorskip("torch")
tokenizers = pytest.importorskip("tokenizers")

NEW = 6
ID_PROMPTS = [[1, 2, 3, 4, 5], [100, 7, 9]]
TEXT = "hello world again hello"
WORDS = {"[UNK]": 0, "hello": 40, "world": 41, "again": 42}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(checkpoint dir, transformers reference model); the dir has a tokenizer.json."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    d = tmp_path_factory.mktemp("f32")
    ref = make_hf_checkpoint(d)
    tok = Tokenizer(WordLevel(WORDS, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(d / "tokenizer.json"))
    assert json.loads((d / "config.json").read_text())["dtype"] == "float32"
    return d, ref


def _reference(ref, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens and the log-prob of each under its own f32 logits."""
    with torch.no_grad():
        g = ref.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                         eos_token_id=None)
    toks = g.sequences[0, len(prompt):].tolist()
    lps = [float(torch.log_softmax(l[0].float(), -1)[t]) for l, t in zip(g.logits, toks)]
    return toks, np.array(lps)


def test_f32_checkpoint_batch_equals_transformers(ckpt, tmp_path):
    d, ref = ckpt
    pfile = tmp_path / "prompts.jsonl"
    pfile.write_text(json.dumps(ID_PROMPTS[0]) + "\n\n" + json.dumps(ID_PROMPTS[1]) + "\n"
                     + json.dumps({"prompt": TEXT}) + "\n")
    r = run("-m", "jlco.generate", "--checkpoint", str(d), "--prompts_file", str(pfile),
            "--max_new_tokens", str(NEW), "--impl", "xla", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert set(out) == {"results", "timing"} and len(out["results"]) == 3
    text_ids = [WORDS[w] for w in TEXT.split()]
    for got, prompt in zip(out["results"], ID_PROMPTS + [text_ids]):
        want_toks, want_lps = _reference(ref, prompt)
        assert got["tokens"] == want_toks, prompt
        np.testing.assert_allclose(got["logprobs"], want_lps, atol=1e-4, rtol=0)
    t = out["timing"]
    assert set(t) == {"compile_s", "prefill_s", "prefill_compile_s", "decode_s",
                      "decode_tokens_per_s", "step_ms_p50", "late_compiles"}
    assert t["prefill_s"] > 0 and t["decode_s"] > 0 and t["step_ms_p50"] > 0
    assert t["decode_tokens_per_s"] > 0 and t["compile_s"] >= 0
    assert 0 <= t["prefill_compile_s"] <= t["prefill_s"]
    assert t["late_compiles"] == 0     # every decode program compiles in the first step
    assert "dtype float32 (from config.json 'dtype')" in r.stderr
    # context follows the request (5 + 6 -> bucket 64 <= 256), one batch of 3
    assert "3 prompt(s), batch 3, context 64" in r.stderr


def test_dtype_flag_single_prompt_json_and_compile_cache(ckpt, tmp_path):
    """--dtype bfloat16 overrides the checkpoint's float32 (log-probs move by more than
    f32 noise: the silent-bf16 bug, now asked for). The same command twice with a fresh
    JLCO_COMPILATION_CACHE_DIR: the second run loads its executables from disk."""
    d, ref = ckpt
    cache = tmp_path / "jax-cache"
    args = ("-m", "jlco.generate", "--checkpoint", str(d), "--prompt_ids",
            ",".join(map(str, ID_PROMPTS[0])), "--max_new_tokens", str(NEW), "--dtype",
            "bfloat16", "--impl", "xla", "--json")
    first = run(*args, env={"JLCO_COMPILATION_CACHE_DIR": str(cache)})
    assert first.returncode == 0, first.stderr[-3000:]
    out = json.loads(first.stdout)
    assert set(out) == {"tokens", "logprobs", "timing"} and len(out["tokens"]) == NEW
    assert "dtype bfloat16 (--dtype)" in first.stderr
    _, want_lps = _reference(ref, ID_PROMPTS[0])
    n = 2   # bf16 may pick other tokens later on
    assert np.abs(np.array(out["logprobs"][:n]) - want_lps[:n]).max() > 1e-3
    assert cache.is_dir() and any(cache.iterdir())
    second = run(*args, env={"JLCO_COMPILATION_CACHE_DIR": str(cache)})
    assert second.returncode == 0, second.stderr[-3000:]
    again = json.loads(second.stdout)
    assert again["tokens"] == out["tokens"]
    cost = lambda t: t["compile_s"] + t["prefill_s"]  # noqa: E731
    assert cost(again["timing"]) < 0.6 * cost(out["timing"]), (out["timing"], again["timing"])


def test_128k_config_without_checkpoint_builds_the_small_model():
    """Peak RSS of the child is measured by a wrapper process (RUSAGE_CHILDREN)."""
    wrapper = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
               "print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "
               "file=sys.stderr); sys.exit(r.returncode)")
    r = run("-c", wrapper, sys.executable, "-m", "jlco.generate", "--config",
            "configs/128k.py", "--prompt_ids", "1,2,3", "--max_new_tokens", "2", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(json.loads(r.stdout)["tokens"]) == 2
    assert "RANDOM-WEIGHT" in r.stderr and "configs/tiny.py's model section" in r.stderr
    assert "context 135168, offload on" in r.stderr
    rss_kb = int(r.stderr.split("MAXRSS_KB")[1].split()[0])
    assert rss_kb < 4 * 2**20, rss_kb
