"""DeepSeek-V4 (`deepseek_v4`) against transformers' DeepseekV4ForCausalLM, f32, tiny.

The reference is `jlco.checkpoint.hf_reference.build_hf_v4_model`: 4 layers (sliding,
CSA, HCA, CSA), hash / routed / routed / hash MoE, window 8, CSA rate 4 with index_topk
3, HCA rate 8, every weight redrawn (norms, sinks, position biases, hyper-connection
bases, hash table). It is saved with `save_pretrained` and loaded by jlco's loader.
Prompts are longer than the window and than index_topk entries, and not a multiple of
either rate, so decode completes windows of both compressors from a carried buffer.
Tolerance: 1e-4 × max|logit| for logits, 1e-4 for log-probs (f32 summation order
differs; measured about 1e-6).
"""

import copy
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file

from jlco.checkpoint.deepseek_v4 import canonical_name, load_v4
from jlco.checkpoint.hf_reference import build_hf_v4_model
from jlco.checkpoint.safetensors_io import CheckpointError
from jlco.model.deepseek_v4 import state as v4_state


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    model = build_hf_v4_model()
    path = tmp_path_factory.mktemp("v4") / "ckpt"
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def loaded(reference):
    return load_v4(reference[1], dtype="float32")


def _prompt(batch: int, length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 64, (batch, length))


def _full(model, tokens) -> np.ndarray:
    """The stateless full-sequence forward, jitted (op by op it takes ~25 s here)."""
    return np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)))


def test_logits_match_transformers(reference, loaded):
    model, _ = reference
    tokens = _prompt(2, 40, 0)
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    got = _full(loaded[1], tokens)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.slow
def test_yarn_compress_rope(tmp_path):
    """A flat YaRN rope_parameters goes to the "compress" RoPE only (attention_factor 1):
    logits match with it (without YaRN they are off by 0.2)."""
    model = build_hf_v4_model(rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0})
    model.save_pretrained(tmp_path)
    tokens = _prompt(1, 40, 7)
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    cfg, jm = load_v4(tmp_path, dtype="float32")
    assert cfg.rope_scaling.factor == 4.0 and cfg.rope_attention_factor == 1.0
    got = _full(jm, tokens)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.slow
def test_greedy_decode_matches_generate(reference, loaded):
    """Prefill 37 tokens in chunks of 5 (across window and rate boundaries), then 20
    one-token steps through the decode state: transformers' greedy tokens, and
    log-probs within 1e-4."""
    model, _ = reference
    prompt, steps = _prompt(1, 37, 1), 20
    with torch.no_grad():
        out = model.generate(torch.from_numpy(prompt), max_new_tokens=steps, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
    want_tokens = out.sequences[0, prompt.shape[1]:].numpy()
    want_lp = torch.stack([torch.log_softmax(s[0].float(), -1) for s in out.scores]).numpy()
    jm = loaded[1]
    logits, state = v4_state.prefill(jm, jnp.asarray(prompt), max_len=64, chunk=5)
    step = nnx.jit(v4_state.decode_step)
    last, tokens, lps = logits[:, -1], [], []
    for _ in range(steps):
        tok = jnp.argmax(last, axis=-1)
        tokens.append(int(tok[0]))
        lps.append(np.asarray(jax.nn.log_softmax(last[0])))
        last, state = step(jm, state, tok)
    np.testing.assert_array_equal(np.array(tokens), want_tokens)
    assert np.abs(np.stack(lps) - want_lp).max() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("chunk, gather", [(3, False), (8, True)])
def test_chunked_prefill_equals_the_full_forward(loaded, chunk, gather, monkeypatch):
    """Chunks smaller than a window and across them; CSA's picks masked (what the tiny
    shapes choose) and gathered (what long contexts choose)."""
    monkeypatch.setattr(v4_state, "gather_picks", lambda s, *_: gather or s == 1)
    jm = loaded[1]
    tokens = jnp.asarray(_prompt(2, 29, 4))
    logits, state = v4_state.prefill(jm, tokens, max_len=32, chunk=chunk)
    full = nnx.jit(lambda m, t: m(t))(jm, tokens)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full), atol=5e-5)
    np.testing.assert_array_equal(np.asarray(state["pos"]), [29, 29])
    with pytest.raises(ValueError, match="exceed the state's room of 32 tokens"):
        v4_state.forward_chunk(jm, state, tokens[:, :4])


@pytest.mark.slow
def test_batched_decode_rows_at_their_own_positions(loaded):
    """Two requests prefilled alone (13 and 22 tokens), installed into a batch of two and
    decoded together: each row's logits are those of decoding it alone."""
    jm = loaded[1]
    step = nnx.jit(v4_state.decode_step)
    prompts = [_prompt(1, 13, 5), _prompt(1, 22, 6)]
    batch = v4_state.init_state(jm.cfg, 2, 40)
    alone, nxt = [], []
    for slot, p in enumerate(prompts):
        logits, one = v4_state.prefill(jm, jnp.asarray(p), max_len=40)
        batch = v4_state.install(batch, slot, one)
        nxt.append(jnp.argmax(logits[:, -1], axis=-1))
        rows = []
        tok = nxt[-1]
        for _ in range(6):
            lg, one = step(jm, one, tok)
            rows.append(np.asarray(lg[0]))
            tok = jnp.argmax(lg, axis=-1)
        alone.append(np.stack(rows))
    tok = jnp.concatenate(nxt)
    for i in range(6):
        lg, batch = step(jm, batch, tok)
        for r in range(2):
            np.testing.assert_allclose(np.asarray(lg[r]), alone[r][i], atol=1e-5)
        tok = jnp.argmax(lg, axis=-1)


def test_sharded_and_original_names_load_the_same(reference, loaded, tmp_path):
    """Shards (an index JSON) holding DeepSeek's unprefixed names (`embed.weight`,
    `layers.N.…`, `hc_head_fn`) plus an MTP tensor (ignored) give the same model."""
    _, path = reference
    tensors = load_file(path / "model.safetensors")
    originals = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn",
                 "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}
    renamed = {originals.get(canonical_name(n), canonical_name(n)): t
               for n, t in tensors.items()}
    renamed["mtp.0.norm.weight"] = np.ones(32, np.float32)
    names = sorted(renamed)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: renamed[n] for n in part}, tmp_path / file)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, part in shards.items() for n in part}}))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    _, again = load_v4(tmp_path, dtype="float32")
    want = dict(nnx.to_flat_state(nnx.state(loaded[1])))
    got = dict(nnx.to_flat_state(nnx.state(again)))
    assert got.keys() == want.keys()
    for path, var in want.items():
        np.testing.assert_array_equal(np.asarray(got[path].get_value()),
                                      np.asarray(var.get_value()), err_msg=str(path))


def test_loader_refuses_a_wrong_checkpoint(reference, tmp_path):
    _, path = reference
    tensors = load_file(path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    bad = dict(tensors)
    del bad["model.layers.1.attn.indexer.wq_b.weight"]
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing tensor 'layers.1.attn.indexer.wq_b"):
        load_v4(tmp_path, dtype="float32")
    bad = dict(tensors)
    bad["model.layers.2.attn.compressor.ape"] = np.zeros((4, 16), np.float32)
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"layers.2.attn.compressor.ape.*expected \[8, 16\]"):
        load_v4(tmp_path, dtype="float32")


@pytest.mark.slow
def test_bf16_checkpoint(reference, tmp_path):
    """A bf16 save (hyper-connections, norms, sinks, position biases stay f32, as
    transformers keeps them) loads; computed in f32 it gives transformers' f32 logits
    on the same bf16 weights."""
    from transformers import DeepseekV4ForCausalLM
    copy.deepcopy(reference[0]).to(torch.bfloat16).save_pretrained(tmp_path)
    ref = DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = _prompt(1, 24, 3)
    with torch.no_grad():
        want = ref(torch.from_numpy(tokens)).logits.numpy()
    _, jm = load_v4(tmp_path, dtype="float32")
    got = _full(jm, tokens)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
