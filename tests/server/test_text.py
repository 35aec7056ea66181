"""jlco.server.text: codecs, the incremental detokenizer with stop strings, chat templates.

transformers is the independent reference for checkpoint tokenizers and chat-template
rendering; the byte-level codec is checked against Python's own UTF-8 codec.
"""

import json
import random

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from jlco.server.text import MAX_HELD_TOKENS, Detokenizer, TextCodec, render_chat

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
TEMPLATE = (          # indented block tags and newlines after them: trim/lstrip_blocks
    "{{ bos_token }}{% for m in messages %}\n"
    "  {% if m['role'] == 'system' %}\n"
    "{{ m['content'] }}\n\n"
    "  {% elif m['role'] == 'user' %}\n"
    + USER + "{{ m['content'] }}\n"
    "  {% elif m['role'] == 'assistant' %}\n"
    + ASSISTANT + "{{ m['content'] }}{{ eos_token }}\n"
    "  {% else %}\n"
    "    {{ raise_exception('unknown role ' + m['role']) }}\n"
    "  {% endif %}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "héllo 世界"},
            {"role": "assistant", "content": "hi 🙂"},
            {"role": "user", "content": "the quick brown fox"}]
MIXED = "héllo 世界 🙂 ok"


def _stream(det, ids):
    return [det.push(i) for i in ids]


# ----------------------------------------------------------------------------- byte-level


@pytest.fixture(scope="module")
def byte_codec():
    return TextCodec.byte_level(512)


@pytest.mark.parametrize("text", ["hello, world", MIXED, "\x00\t\r\n <|endoftext|> \u00ff",
                                  "", "\ufffd literal"])
def test_byte_level_round_trip(byte_codec, text):
    ids = byte_codec.encode(text)
    assert ids == list(text.encode("utf-8"))      # a literal <|endoftext|> is bytes too
    assert byte_codec.decode(ids) == text


def test_byte_level_codec_fields(byte_codec):
    assert byte_codec.vocab_size == 257
    assert byte_codec.eos_token_id == 256 and byte_codec.eos_token == "<|endoftext|>"
    assert "byte-level" in byte_codec.name
    from jlco.server.text import render_chat
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert render_chat(byte_codec.chat_template, msgs, add_generation_prompt=True) == \
        "system: be brief\nuser: hi\nassistant: "


def test_byte_level_too_small_vocab():
    with pytest.raises(ValueError, match=r"model\.vocab_size=256.*>= 257"):
        TextCodec.byte_level(256)
    assert TextCodec.byte_level(257).vocab_size == 257


def test_undecodable_ids_decode_to_nothing(byte_codec):
    assert byte_codec.decode([104, 300, 256, 511, 105]) == "hi"
    det = Detokenizer(byte_codec)
    assert _stream(det, [300, 104, 256, 511, 105, 400]) == ["", "h", "", "", "i", ""]
    assert det.finish() == ""


def test_streamed_pieces_concatenate_to_decode(byte_codec):
    ids = byte_codec.encode(MIXED)
    det = Detokenizer(byte_codec)
    pieces = _stream(det, ids)
    assert all("\ufffd" not in p for p in pieces)    # partial characters are held back
    assert pieces[:3] == ["h", "", "é"]
    assert "".join(pieces) + det.finish() == MIXED


def test_random_ids_stream_equals_decode(byte_codec):
    """Random bytes (invalid UTF-8 included) and unknown ids: the stream's text is what
    decoding all ids at once gives."""
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(512) for _ in range(300)]
        det = Detokenizer(byte_codec)
        assert "".join(_stream(det, ids)) + det.finish() == byte_codec.decode(ids)


def test_invalid_bytes_are_not_held_forever(byte_codec):
    """A run of text ending in U+FFFD is held for at most MAX_HELD_TOKENS ids."""
    ids = [0x80] * (3 * MAX_HELD_TOKENS)
    det = Detokenizer(byte_codec)
    pieces = _stream(det, ids)
    assert pieces[MAX_HELD_TOKENS - 1] == "\ufffd" * MAX_HELD_TOKENS
    assert not any(pieces[:MAX_HELD_TOKENS - 1])
    assert "".join(pieces) + det.finish() == byte_codec.decode(ids) == "\ufffd" * len(ids)


def test_finish_flushes_incomplete_character(byte_codec):
    det = Detokenizer(byte_codec)
    assert _stream(det, [104, 0xE4, 0xB8]) == ["h", "", ""]
    assert det.finish() == "\ufffd"
    assert det.finish() == ""


# ----------------------------------------------------------------------------- stop strings


def _run(codec, text, stop, include_stop=False):
    det = Detokenizer(codec, stop, include_stop=include_stop)
    pieces = []
    for i in codec.encode(text):
        if det.stopped:
            break
        pieces.append(det.push(i))
        assert len(det.held) <= max(map(len, stop)) - 1
    return "".join(pieces) + det.finish(), det


def test_stop_string_split_across_tokens(byte_codec):
    text, det = _run(byte_codec, "Hello world! STOP and more", ["STOP"])
    assert text == "Hello world! "
    assert det.stopped and det.stop_string == "STOP"
    assert det.push(byte_codec.encode("x")[0]) == "" and det.finish() == ""


def test_stop_string_included(byte_codec):
    text, det = _run(byte_codec, "a 世界 b 世界", ["世界"], include_stop=True)
    assert text == "a 世界" and det.stop_string == "世界"


def test_earliest_ending_stop_wins(byte_codec):
    assert _run(byte_codec, "xabcx", ["abc", "b"])[0] == "xa"
    assert _run(byte_codec, "xabcx", ["abc", "ab"])[0] == "x"
    assert _run(byte_codec, "xabcx", ["bc", "abc"])[0] == "x"


def test_hold_back_bound_and_finish_flush(byte_codec):
    stop = ["xyzw", "ab"]
    det = Detokenizer(byte_codec, stop)
    out, held_max = [], 0
    for i in byte_codec.encode("a xy xyz, hello xyz"):
        out.append(det.push(i))
        held_max = max(held_max, len(det.held))
        assert len(det.held) <= 3
    assert held_max == 3 and det.held == "xyz" and "".join(out) == "a xy xyz, hello "
    assert det.finish() == "xyz" and not det.stopped and det.stop_string is None


def test_stop_chunking_independent(ck_codec):
    """Multi-character tokens: the same text as byte by byte."""
    text = "hello world, the quick brown fox jumps over the lazy dog"
    stop = ["brown", "fox", "he q"]
    want = "hello world, t"
    assert _run(ck_codec, text, stop)[0] == want
    assert _run(TextCodec.byte_level(257), text, stop)[0] == want


def test_no_codec_no_text():
    det = Detokenizer(None, ["x"])
    assert det.push(5) == "" and det.finish() == "" and not det.stopped


def test_bad_stop_string(byte_codec):
    with pytest.raises(ValueError, match=r"stop\[1\]"):
        Detokenizer(byte_codec, ["ok", ""])


# ----------------------------------------------------------------------------- checkpoints


def _write_checkpoint(path, *, bos_post_processor=True, config=None, **files):
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[BOS, EOS, USER, ASSISTANT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 5
                            + [MIXED], trainer)
    if bos_post_processor:
        tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A",
                                                           special_tokens=[(BOS, 0)])
    tok.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, body in files.items():
        (path / name).write_text(json.dumps(body))
    return tok


def _config(**over):
    return {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE,
            "bos_token": {"__type": "AddedToken", "content": BOS}, "eos_token": EOS, **over}


@pytest.fixture(scope="module")
def ck_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ck")
    _write_checkpoint(path, config=_config())
    return path


@pytest.fixture(scope="module")
def ck_codec(ck_dir):
    return TextCodec.from_checkpoint(ck_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(ck_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(ck_dir))


def test_checkpoint_fields(ck_codec, ck_dir, hf_tokenizer):
    assert ck_codec.name == str(ck_dir / "tokenizer.json")
    assert ck_codec.bos_token == BOS == hf_tokenizer.bos_token
    assert ck_codec.eos_token == EOS == hf_tokenizer.eos_token
    assert ck_codec.eos_token_id == 1 == hf_tokenizer.eos_token_id
    assert ck_codec.vocab_size == len(hf_tokenizer) > 256
    assert ck_codec.chat_template == TEMPLATE


def test_checkpoint_matches_transformers(ck_codec, hf_tokenizer):
    for text in ["hello world", MIXED, "the lazy dog" + EOS]:
        ids = ck_codec.encode(text)
        assert ids == hf_tokenizer.encode(text) and ids[0] == 0
        assert ck_codec.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
        det = Detokenizer(ck_codec)
        assert "".join(_stream(det, ids)) + det.finish() == ck_codec.decode(ids)


@pytest.mark.parametrize("add_bos", [True, False])
def test_add_bos_token_decides(tmp_path, add_bos):
    """tokenizer_config.json's add_bos_token wins over tokenizer.json's post-processor."""
    tok = _write_checkpoint(tmp_path, bos_post_processor=not add_bos,
                            config=_config(add_bos_token=add_bos))
    codec = TextCodec.from_checkpoint(tmp_path)
    plain = tok.encode("hello world", add_special_tokens=False).ids
    assert codec.encode("hello world") == ([0] if add_bos else []) + plain
    assert codec.encode_chat(BOS + "hello world") == [0] + plain


def test_eos_fallbacks(tmp_path):
    _write_checkpoint(tmp_path, config={"chat_template": [{"name": "default",
                                                           "template": "{{ 1 }}"}]},
                      **{"generation_config.json": {"eos_token_id": [3, 1]},
                         "config.json": {"eos_token_id": 2}})
    codec = TextCodec.from_checkpoint(tmp_path)
    assert codec.eos_token_id == 3 and codec.eos_token == ASSISTANT
    assert codec.stop_token_ids == (3, 1)      # every listed id ends a reply
    assert codec.bos_token is None and codec.chat_template == "{{ 1 }}"
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "chat_template.jinja").write_text("{{ 2 }}")
    codec = TextCodec.from_checkpoint(tmp_path)
    assert codec.eos_token_id == 2 and codec.chat_template == "{{ 2 }}"
    assert codec.stop_token_ids == ()


def test_no_tokenizer_json(tmp_path):
    assert TextCodec.from_checkpoint(tmp_path) is None


@pytest.mark.parametrize("body, problem", [
    ('{"model": ', "not valid JSON"),
    ('{"model": {"type": "Bogus"}}', "the tokenizers library refuses it"),
    ("[1, 2]", "not a tokenizer"),
])
def test_bad_tokenizer_json(tmp_path, body, problem):
    (tmp_path / "tokenizer.json").write_text(body)
    with pytest.raises(ValueError, match="tokenizer.json: " + problem):
        TextCodec.from_checkpoint(tmp_path)


@pytest.mark.parametrize("config, problem", [
    ("{oops", "tokenizer_config.json: not valid JSON"),
    ({"eos_token": "<nope>"}, "eos_token='<nope>' is not in tokenizer.json's vocabulary"),
    ({"add_bos_token": "yes"}, "add_bos_token='yes' is invalid"),
    ({"bos_token": 3}, "bos_token=3 is invalid"),
    ([1], "tokenizer_config.json: a JSON object is expected"),
])
def test_bad_tokenizer_config(tmp_path, config, problem):
    _write_checkpoint(tmp_path)
    body = config if isinstance(config, str) else json.dumps(config)
    (tmp_path / "tokenizer_config.json").write_text(body)
    with pytest.raises(ValueError, match=problem):
        TextCodec.from_checkpoint(tmp_path)


# ----------------------------------------------------------------------------- chat


@pytest.mark.parametrize("add_gen", [True, False])
def test_render_chat_matches_transformers(ck_codec, hf_tokenizer, add_gen):
    got = render_chat(ck_codec.chat_template, MESSAGES, add_generation_prompt=add_gen,
                      bos_token=ck_codec.bos_token, eos_token=ck_codec.eos_token)
    assert got == hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                                   add_generation_prompt=add_gen)
    ref = hf_tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=add_gen)
    assert ck_codec.encode_chat(got) == list(ref["input_ids"])


def test_render_chat_hand_checked():
    got = render_chat(TEMPLATE, MESSAGES[:3], bos_token="<s>", eos_token="</s>")
    assert got == f"<s>Be brief.\n\n{USER}héllo 世界\n{ASSISTANT}hi 🙂</s>\n{ASSISTANT}"


def test_render_chat_filters_and_globals(hf_tokenizer):
    template = ("{{ messages | tojson }}{% for m in messages %}{% if loop.index > 1 %}"
                "{% break %}{% endif %}{% generation %}[{{ m.role }}]{% endgeneration %}"
                "{% endfor %}")
    got = render_chat(template, MESSAGES[1:2])
    assert got == '[{"role": "user", "content": "héllo 世界"}][user]'
    assert got == hf_tokenizer.apply_chat_template(MESSAGES[1:2], chat_template=template,
                                                   tokenize=False)


def test_render_chat_template_errors():
    with pytest.raises(ValueError, match="^unknown role tool$"):
        render_chat(TEMPLATE, [{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="does not parse"):
        render_chat("{% for %}", MESSAGES)
    with pytest.raises(ValueError, match="the chat template failed"):
        render_chat("{{ messages[0].content + 1 }}", MESSAGES)
    with pytest.raises(ValueError, match="the chat template failed.*unsafe"):
        render_chat("{{ messages.__class__.__mro__ }}", MESSAGES)


@pytest.mark.parametrize("messages, field", [
    ([], r"^messages is invalid"),
    ("hi", r"^messages is invalid"),
    ([{"role": "user", "content": "a"}, "b"], r"^messages\[1\] is invalid"),
    ([{"role": "user", "content": "a"}, {"content": "b"}], r"^messages\[1\]\.role is invalid"),
    ([{"role": "", "content": "b"}], r"^messages\[0\]\.role is invalid"),
    ([{"role": "user", "content": None}], r"^messages\[0\]\.content is invalid"),
])
def test_render_chat_bad_messages(messages, field):
    with pytest.raises(ValueError, match=field):
        render_chat(TEMPLATE, messages)
