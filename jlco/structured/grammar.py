"""Grammars as token constraints, with llguidance (the grammar engine vLLM and SGLang
offer beside xgrammar; chosen here because it is one small wheel with no dependencies,
where xgrammar pulls torch, triton and transformers into a serving install).

`GrammarSpec` is what a request asks for, in one of KINDS: a JSON schema, any JSON
object, a regex, one of a list of strings, or a Lark grammar (GBNF, what vLLM's
`grammar` usually holds, is converted). `Grammars` holds one tokenizer's llguidance view
and compiles each distinct spec once (an LRU cache keyed by the spec's canonical text);
`constraint(spec)` gives a fresh matcher per request. Compiling and building a matcher
can take from a millisecond to a second for a large schema, so the server calls them on
a worker thread, never on the engine thread. JSON is generated compact (no free
whitespace between tokens: a model cannot pad forever), as vLLM does by default with
llguidance.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

from jlco.sampling.constraint import TokenConstraint

KINDS = ("json", "json_object", "regex", "choice", "grammar")
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A spec llguidance cannot compile (the message says where)."""


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """kind: one of KINDS; source: the schema as canonical JSON text (json), the regex,
    the choices as a JSON list (choice), the grammar text (grammar); "" for json_object."""
    kind: str
    source: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r}: allowed one of {KINDS}")

    @classmethod
    def json_schema(cls, schema: dict) -> "GrammarSpec":
        return cls("json", json.dumps(schema, sort_keys=True, separators=(",", ":")))

    @classmethod
    def choices(cls, options: list[str]) -> "GrammarSpec":
        return cls("choice", json.dumps(list(options)))


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar of `spec` (not yet checked against a tokenizer)."""
    m = llguidance.LLMatcher
    if spec.kind == "json":
        return m.grammar_from_json_schema(spec.source, defaults=_JSON_OPTIONS)
    if spec.kind == "json_object":
        return m.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if spec.kind == "regex":
        return m.grammar_from_regex(spec.source)
    if spec.kind == "choice":
        options = json.loads(spec.source)
        return m.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
    lark = gbnf_to_lark(spec.source) if "::=" in spec.source else spec.source
    return m.grammar_from_lark(lark)


class Grammar(TokenConstraint):
    """One request's matcher: the mask of what may follow, advanced by each token."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str):
        self.text = grammar      # what another process builds the same matcher from
        self.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)

    def fill(self, row: np.ndarray) -> None:
        if self.matcher.is_error():      # nothing may follow: the request ends with EOS
            return
        assert row.dtype == np.int32 and row.flags["C_CONTIGUOUS"]
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def consume(self, token: int) -> None:
        self.matcher.consume_token(token)

    @property
    def stopped(self) -> bool:
        return self.matcher.is_stopped() or self.matcher.is_error()


class Grammars:
    """Constraints over one tokenizer (a `tokenizers.Tokenizer`, model vocabulary
    `vocab_size` >= the tokenizer's, its EOS id ending an accepted output)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None,
                 cache_size: int = 256):
        self.tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size,
                                                eos_token=eos_token_id)
        self.compile = functools.lru_cache(maxsize=cache_size)(self._compile)

    def _compile(self, spec: GrammarSpec) -> str:
        try:
            text = grammar_text(spec)
        except (ValueError, GbnfToLarkError) as err:
            raise GrammarError(str(err)) from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            text, self.tokenizer)
        if failed:
            raise GrammarError(messages[0].strip().splitlines()[0][:300])
        return text

    def constraint(self, spec: GrammarSpec) -> Grammar:
        """A fresh matcher for `spec` (compiled once per distinct spec), or GrammarError."""
        return Grammar(self.tokenizer, self.compile(spec))

    def from_text(self, text: str) -> Grammar:
        """A fresh matcher for a grammar another process compiled (its `Grammar.text`)."""
        return Grammar(self.tokenizer, text)
