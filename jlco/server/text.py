"""Text in and out of the server: tokenizer, incremental detokenizer, chat templates.

`TextCodec` wraps a `tokenizers.Tokenizer` (never `transformers`, which the server does
not depend on). A checkpoint's codec comes from its tokenizer.json plus the metadata
transformers would read next to it; the random-weight demo model gets a byte-level
codec, so text in gives text out without any tokenizer file.

BOS rule: when tokenizer_config.json sets `add_bos_token`, `encode` puts `bos_token` in
front iff it is true (DeepSeek-V3: `<｜begin▁of▁sentence｜>`) and adds nothing else,
whatever tokenizer.json's post-processor says (transformers 4's LlamaTokenizerFast, the
class DeepSeek names, rebuilds its post-processor the same way; transformers 5 ignores
the key when there is a tokenizer.json, which matters only where the two files
disagree); without the key, tokenizer.json's own post-processor decides (what
`jlco.generate` does today). `add_eos_token` is ignored: a prompt never ends in EOS.
`encode_chat` adds nothing: chat templates render `{{ bos_token }}` themselves, as
`apply_chat_template` assumes. The demo model's byte-level codec carries
`PLAIN_CHAT_TEMPLATE` ("role: content" lines, then "assistant: "), so chat works
without a checkpoint.
Decoding skips special tokens (vLLM's and OpenAI's default) and ids the tokenizer does
not know, so any id the model can emit decodes to something, possibly "".

`Detokenizer` turns a request's token ids into text once, for streamed and whole
responses alike, so a stream's pieces concatenate to the non-streamed text. It decodes a
short window of ids and diffs against the window's already-emitted prefix (vLLM's
prefix/read offsets) rather than using `tokenizers.decoders.DecodeStream`, because that
cannot flush held-back bytes when a request ends and errors on a window whose prefix
changes. Text is held back while it ends in an incomplete UTF-8 character (U+FFFD) and
while its tail could still grow into a stop string.

`render_chat` renders a Hugging Face chat template in the sandboxed jinja2 environment
transformers uses, with the same globals and filters.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

REPLACEMENT = "\ufffd"      # what a lossy UTF-8 decode yields for incomplete bytes
# Ids held while the text ends in U+FFFD. A UTF-8 character spans at most 4 byte tokens;
# the rest is room for skipped ids in between. Past it the text is final as it stands
# (then it can differ from decoding all ids at once), so garbage output never makes each
# push decode an ever longer window.
MAX_HELD_TOKENS = 64
BYTE_EOS = "<|endoftext|>"
BYTE_VOCAB = 257            # 256 byte tokens + BYTE_EOS


# ----------------------------------------------------------------------------- codec


@dataclasses.dataclass(frozen=True, eq=False)
class TextCodec:
    """Token ids <-> text for one tokenizer. `add_bos` None: tokenizer.json's
    post-processor decides which special tokens `encode` adds (see the module docstring).
    """
    tokenizer: tokenizers.Tokenizer
    name: str
    bos_token: str | None = None
    eos_token: str | None = None
    eos_token_id: int | None = None
    chat_template: str | None = None
    add_bos: bool | None = None
    # generation_config.json's eos_token_id list: every id ends a reply (GLM-5 lists several)
    stop_token_ids: tuple[int, ...] = ()

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows (0..vocab_size-1, added tokens included); a model's
        vocab_size may be larger."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.tokenizer.token_to_id(self.bos_token)

    def encode(self, text: str) -> list[int]:
        """Prompt text -> ids, with a BOS in front when the checkpoint's tokenizer adds one."""
        if self.add_bos is None:
            return self.tokenizer.encode(text).ids
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if self.add_bos else ids

    def encode_chat(self, text: str) -> list[int]:
        """A rendered chat template -> ids, adding no special token (the template has
        rendered its own BOS)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text; special tokens and ids outside 0..vocab_size-1 decode to ""."""
        n = self.vocab_size
        return self.tokenizer.decode([int(i) for i in ids if 0 <= i < n],
                                     skip_special_tokens=True)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike) -> TextCodec | None:
        """The codec of checkpoint dir `path`, or None if it has no tokenizer.json. Reads
        tokenizer_config.json (bos/eos, add_bos_token, chat_template), chat_template.jinja
        (wins over the config's template, as in transformers), special_tokens_map.json,
        and generation_config.json then config.json for `eos_token_id` when no config
        names an eos_token. A bad file is a ValueError naming it and the problem."""
        path = pathlib.Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            return None
        tok = _load_tokenizer(tok_file)
        cfg = _read_object(path / "tokenizer_config.json")
        special = _read_object(path / "special_tokens_map.json")
        where = tok_file.with_name("tokenizer_config.json")
        add_bos = cfg.get("add_bos_token")
        if add_bos is not None and not isinstance(add_bos, bool):
            raise ValueError(f"{where}: add_bos_token={add_bos!r} is invalid: allowed true "
                             "or false")
        bos = _token_name(cfg, "bos_token", where) or _token_name(special, "bos_token", where)
        eos = _token_name(cfg, "eos_token", where) or _token_name(special, "eos_token", where)
        if add_bos and bos is None:
            add_bos = False     # transformers does the same: no BOS to add
        for field, token in (("bos_token", bos), ("eos_token", eos)):
            if token is not None and tok.token_to_id(token) is None:
                raise ValueError(f"{where}: {field}={token!r} is not in {tok_file.name}'s "
                                 "vocabulary")
        eos_id = tok.token_to_id(eos) if eos is not None else _fallback_eos_id(path, tok)
        if eos is None and eos_id is not None:
            eos = tok.id_to_token(eos_id)
        return cls(tok, name=str(tok_file), bos_token=bos, eos_token=eos, eos_token_id=eos_id,
                   chat_template=_chat_template(path, cfg), add_bos=add_bos,
                   stop_token_ids=tuple(_eos_ids(path, "generation_config.json", tok)))

    @classmethod
    def byte_level(cls, vocab_size: int) -> TextCodec:
        """The demo model's codec: ids 0..255 are the UTF-8 bytes, 256 is <|endoftext|>
        (its EOS). Any text round-trips exactly (a literal "<|endoftext|>" in a prompt is
        bytes, never the EOS id); the model's ids >= 257 decode to ""."""
        if vocab_size < BYTE_VOCAB:
            raise ValueError(f"model.vocab_size={vocab_size} is too small for the byte-level "
                             f"tokenizer: allowed >= {BYTE_VOCAB} (256 bytes + {BYTE_EOS})")
        alphabet = _byte_alphabet()
        tok = tokenizers.Tokenizer(tokenizers.models.BPE(
            vocab={alphabet[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                use_regex=False)
        tok.decoder = tokenizers.decoders.ByteLevel()
        tok.add_special_tokens([tokenizers.AddedToken(BYTE_EOS, special=True,
                                                      normalized=False)])
        tok.encode_special_tokens = True
        return cls(tok, name=f"byte-level (256 bytes + {BYTE_EOS})", eos_token=BYTE_EOS,
                   eos_token_id=tok.token_to_id(BYTE_EOS), add_bos=False,
                   chat_template=PLAIN_CHAT_TEMPLATE)


# The demo model's chat template (it has no checkpoint to carry one): one "role: content"
# line per message, then "assistant: " when a reply is to follow.
PLAIN_CHAT_TEMPLATE = (
    "{% if tools %}tools: {{ tools | tojson }}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] or [] %} [call {{ c['function']['name'] }} "
    "{{ c['function']['arguments'] }}]{% endfor %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the symbols ByteLevel works on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(rest)}}


def _read_text(path: pathlib.Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text: {err}") from None


def _parse(path: pathlib.Path, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from None


def _read_json(path: pathlib.Path) -> Any:
    """The parsed JSON of `path`, None if it does not exist."""
    return _parse(path, _read_text(path)) if path.is_file() else None


def _read_object(path: pathlib.Path) -> dict:
    """The JSON object in `path`, {} if it does not exist."""
    raw = _read_json(path)
    if raw is not None and not isinstance(raw, dict):
        raise ValueError(f"{path}: a JSON object is expected, got {type(raw).__name__}")
    return raw or {}


def _load_tokenizer(path: pathlib.Path) -> tokenizers.Tokenizer:
    text = _read_text(path)
    raw = _parse(path, text)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a tokenizer (a JSON object is expected, got "
                         f"{type(raw).__name__})")
    try:
        return tokenizers.Tokenizer.from_str(text)
    except Exception as err:   # noqa: BLE001 (the library raises bare Exceptions)
        raise ValueError(f"{path}: the tokenizers library refuses it: {err}") from None


def _token_name(cfg: dict, field: str, where: pathlib.Path) -> str | None:
    """A special token's text from a config: a string or an AddedToken {"content"}."""
    if cfg.get(field) is None:
        return None
    value = cfg[field]
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: {field}={cfg[field]!r} is invalid: allowed a token string "
                         "or {\"content\": token}")
    return value


def _eos_ids(path: pathlib.Path, name: str, tok: tokenizers.Tokenizer) -> list[int]:
    """Every `eos_token_id` of config file `name` (an id or a list of them)."""
    cfg = _read_json(path / name)
    value = cfg.get("eos_token_id") if isinstance(cfg, dict) else None
    values = [] if value is None else value if isinstance(value, list) else [value]
    n = tok.get_vocab_size(with_added_tokens=True)
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n for v in values):
        raise ValueError(f"{path / name}: eos_token_id={value!r} is invalid: allowed a "
                         "token id of tokenizer.json (or a list of them)")
    return values


def _fallback_eos_id(path: pathlib.Path, tok: tokenizers.Tokenizer) -> int | None:
    """`eos_token_id` of generation_config.json, else config.json (the first of a list)."""
    for name in ("generation_config.json", "config.json"):
        ids = _eos_ids(path, name, tok)
        if ids:
            return ids[0]
    return None


def _chat_template(path: pathlib.Path, cfg: dict) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's chat_template (a string, or the
    list form's "default" entry)."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return _read_text(jinja)
    value = cfg.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{path / 'tokenizer_config.json'}: chat_template is invalid: "
                         "allowed a string or a list of {\"name\", \"template\"}")
    return value


# ----------------------------------------------------------------------------- detokenizer


class Detokenizer:
    """One request's ids -> text, incrementally (see the module docstring).

    `push(id)` returns the text that became final; `finish()` flushes what is held when
    the request ends for another reason than a stop string. Once a stop string matches,
    `stopped` is set, `stop_string` names it, the text up to it (through it with
    `include_stop`) has been returned, and push/finish return "". The earliest-ending
    match wins, so the result does not depend on how text splits into tokens. With
    `codec` None (a checkpoint without tokenizer.json) there is no text: every call
    returns "" and stop strings never match. With `min_tokens` (vLLM's), no stop string
    is looked for before that many tokens were pushed.
    """

    def __init__(self, codec: TextCodec | None, stop: Sequence[str] = (),
                 include_stop: bool = False, min_tokens: int = 0):
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop[{i}]={s!r} is invalid: allowed a non-empty string")
        self.codec = codec
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self.min_tokens, self._pushed = min_tokens, 0
        self.stopped = False
        self.stop_string: str | None = None
        self._ids: list[int] = []
        self._prefix = 0            # ids[_prefix:_read] decode to _prefix_text (context)
        self._read = 0              # ids[_read:] are not emitted yet
        self._prefix_text = ""
        self._held = ""             # decoded text kept back: it may start a stop string

    @property
    def held(self) -> str:
        """Decoded text kept back because it may begin a stop string."""
        return self._held

    def push(self, token_id: int) -> str:
        if self.stopped or self.codec is None:
            return ""
        self._pushed += 1
        new = self._step(int(token_id))
        if self._pushed < self.min_tokens:
            out, self._held = self._held + new, ""
            return out
        return self._release(new, final=False)

    def finish(self) -> str:
        if self.stopped or self.codec is None:
            return ""
        rest = self.codec.decode(self._ids[self._prefix:])[len(self._prefix_text):]
        self._prefix = self._read = len(self._ids)
        self._prefix_text = ""
        return self._release(rest, final=True)

    def _step(self, token_id: int) -> str:
        """Decoded text that `token_id` makes final: the window's text past what was
        emitted, unless it ends in U+FFFD (an incomplete character, or an invalid byte
        that the next token shows as such). Windows start where text ended cleanly, so
        byte-level text decoded window by window equals decoding all ids at once."""
        self._ids.append(token_id)
        text = self.codec.decode(self._ids[self._prefix:])
        if text.endswith(REPLACEMENT) and len(self._ids) - self._read < MAX_HELD_TOKENS:
            return ""
        new = text[len(self._prefix_text):]
        self._prefix_text = self.codec.decode(self._ids[self._read:])
        del self._ids[:self._read]
        self._prefix, self._read = 0, len(self._ids)
        return new

    def _release(self, new: str, final: bool) -> str:
        """Of held + new text, what is final: cut at a stop string, else all but the
        longest tail that could still begin one."""
        buf = self._held + new
        hit = _first_stop(buf, self.stop)
        if hit is not None:
            start, s = hit
            self.stopped, self.stop_string, self._held = True, s, ""
            return buf[:(start + len(s)) if self.include_stop else start]
        keep = 0 if final else _stop_prefix_len(buf, self.stop)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]


def _first_stop(text: str, stop: Sequence[str]) -> tuple[int, str] | None:
    """(start, stop string) of the match that ends first (then starts first), or None."""
    best = None
    for s in stop:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
            best = (i, s)
    return best


def _stop_prefix_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string
    (at most max(len(s)) - 1)."""
    longest = max((len(s) for s in stop), default=1)
    for k in range(min(longest - 1, len(text)), 0, -1):
        tail = text[-k:]
        if any(len(s) > k and s.startswith(tail) for s in stop):
            return k
    return 0


# ----------------------------------------------------------------------------- chat


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant spans for
    training with it): renders its body unchanged."""
    tags = frozenset({"generation"})

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise ValueError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson: no HTML escaping, json.dumps' options."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"the chat template does not parse (line {err.lineno}): "
                         f"{err.message}") from None


def render_chat(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", tools: list | None = None,
                **kwargs) -> str:
    """`messages` rendered by Hugging Face chat `template` as transformers'
    `apply_chat_template(..., tokenize=False)` does (`tools` the request's, documents
    None, `kwargs` the request's chat_template_kwargs). Bad messages, a template that
    does not parse, or one that fails (its `raise_exception` included) are ValueErrors."""
    _check_messages(messages)
    compiled = _compile(template)
    try:
        return compiled.render(**{**kwargs, "messages": [dict(m) for m in messages],
                                  "tools": tools or None, "documents": None,
                                  "add_generation_prompt": add_generation_prompt,
                                  "bos_token": bos_token, "eos_token": eos_token})
    except ValueError:
        raise                   # raise_exception(...): the template's own message
    except Exception as err:   # noqa: BLE001 (any failure inside a template is its error)
        raise ValueError(f"the chat template failed: {type(err).__name__}: {err}") from None


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages is invalid: allowed a non-empty list of "
                         "{\"role\": str, \"content\": str} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] is invalid: allowed a {{\"role\", \"content\"}} "
                             "object")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise ValueError(f"messages[{i}].role is invalid: allowed a non-empty string")
        if not isinstance(m.get("content"), str) and not (m.get("content") is None
                                                          and m.get("tool_calls")):
            raise ValueError(f"messages[{i}].content is invalid: allowed a string")
