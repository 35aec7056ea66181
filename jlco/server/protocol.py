"""The OpenAI-compatible request fields jlco serves, validated into plain parameters, and
the error shape every refusal uses.

Requests follow OpenAI's conventions, vLLM's where OpenAI is silent (top_k, seed,
stop_token_ids, ignore_eos, return_token_ids, include_stop_str_in_output). A field jlco
does not implement is accepted when its value asks for nothing (`presence_penalty: 0`,
`repetition_penalty: 1.0`, `n: 1`, ...) and refused otherwise, naming the field and what
is allowed; a field nobody defines is refused too (a typo must not pass silently).
Refusals are `ApiError`s, rendered as vLLM does:
`{"error": {"message", "type", "param", "code"}}` with the HTTP status as `code`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jlco.sampling.params import MAX_LOGPROBS, SamplingParams
from jlco.sampling.penalties import Penalties
from jlco.structured.grammar import GrammarSpec
from jlco.structured.request import FieldError, read_structured
from jlco.structured.tools import ToolRequest, read_tools

DEFAULT_MAX_TOKENS = 16        # OpenAI's (and vLLM's) default for /v1/completions
MAX_STOP_STRINGS = 16

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               413: "RequestTooLargeError", 429: "TooManyRequestsError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}


class ApiError(Exception):
    """A refused request: HTTP `status`, a message naming the field and what is allowed,
    and the field (`param`)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}


def bad(field: str, message: str) -> ApiError:
    return ApiError(400, f"{field}: {message}", field)


# Fields that ask for nothing at these values (anything else is refused: jlco cannot do it).
_NOOP_FIELDS: dict[str, tuple] = {
    "best_of": (None, 1), "suffix": (None,), "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,), "use_beam_search": (False,),
    "length_penalty": (1, 1.0), "prompt_logprobs": (None,), "add_special_tokens": (True,),
    "truncate_prompt_tokens": (None,), "priority": (0,),
}
_FREE_FIELDS = {"user", "request_id", "metadata", "store", "service_tier"}   # informational


@dataclasses.dataclass(frozen=True)
class SamplingRequest:
    """One generation request (either endpoint), its HTTP side validated: fields known,
    JSON types, OpenAI's names and defaults. The sampling values are checked once, when
    the server makes each choice's `SamplingParams` (`params`); token ids against the
    vocabulary and the lengths by the engine when it queues the request."""
    prompt_text: str | None        # text to tokenize (None: prompt_ids given)
    prompt_ids: list[int] | None
    max_tokens: int | None         # None: up to the context limit
    temperature: Any               # as sent (default 1.0): `params` checks it
    top_p: Any                     # as sent (default 1.0)
    top_k: Any                     # as sent, vLLM's -1 as 0 (= off)
    seed: Any                      # as sent; None: the server draws one
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    include_stop_str_in_output: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool
    model: str | None
    prefill_id: int | None = None  # kv_transfer_params.prefill_id: claim an imported prefill
    logprobs: int | None = None    # alternatives per token (None: no log-probs; 0: sampled only)
    echo: bool = False             # completions: the prompt (and its log-probs) returned too
    n: int = 1                     # choices per prompt
    more_prompts: tuple = ()       # completions: (text, ids) of prompts after the first
    penalties: Penalties = Penalties()   # as sent (`SamplingParams.check` checks them)
    min_p: Any = 0.0
    structured: GrammarSpec | None = None   # response_format / structured_outputs
    tools: ToolRequest | None = None        # chat: tools and tool_choice
    template_kwargs: dict = dataclasses.field(default_factory=dict)  # chat_template_kwargs


    def params(self, *, seed: int, stop_token_ids, constraint=None) -> SamplingParams:
        """One choice's sampling parameters (its seed, the stop ids with the tokenizer's,
        a fresh constraint); a bad value raises RequestError naming the field."""
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=seed, stop_token_ids=tuple(stop_token_ids),
            top_logprobs=self.logprobs or 0,
            prompt_logprobs=(self.logprobs or 0) if self.echo else None,
            penalties=self.penalties, constraint=constraint)

    @classmethod
    def plain(cls) -> "SamplingRequest":
        """A request with every field at its default (what /tokenize renders a chat with)."""
        return parse_chat({"messages": [{"role": "user", "content": ""}]})[0]


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise ApiError(400, f"request body: not valid JSON ({err})") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body: must be a JSON object")
    return body


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _or_default(v: Any, default: Any) -> Any:
    return default if v is None else v


def _kind(v: Any) -> type:
    """JSON's type of `v`: a boolean is not a number, 1 and 1.0 are one number."""
    return float if isinstance(v, (int, float)) and not isinstance(v, bool) else type(v)


def asks_nothing(v: Any, allowed: tuple) -> bool:
    """`v` is null or one of `allowed` with its JSON type (`true` is not 1, `0` not false)."""
    return v is None or any(_kind(v) is _kind(a) and v == a for a in allowed)


def _whole(v: Any) -> Any:
    """An integral float as the int vLLM's pydantic models make of it (2.0 → 2); anything
    else as sent (the check that reads it refuses what is not an integer)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


MAX_PROMPTS = 256   # prompts in one completions request
MAX_N = 16          # choices per prompt


def _one_prompt(v: Any, field: str) -> tuple[str | None, list[int] | None]:
    if isinstance(v, str):
        if not v:
            raise bad(field, "must not be empty")
        return v, None
    if isinstance(v, list) and v and all(_is_int(t) for t in v):
        return None, list(v)
    raise bad(field, "allowed a non-empty string or a non-empty list of token ids")


def _prompts(v: Any) -> list[tuple[str | None, list[int] | None]]:
    """`prompt`: a string, a list of token ids, or a list of either (one choice per
    prompt and per `n`, numbered prompt by prompt, as OpenAI does)."""
    if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
        if len(v) > MAX_PROMPTS:
            raise bad("prompt", f"{len(v)} prompts: allowed at most {MAX_PROMPTS} per request")
        return [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(v)]
    return [_one_prompt(v, "prompt")]


def int_field(body: dict, name: str, default: Any, lo: int, hi: int | None = None) -> Any:
    """An integer field as vLLM's pydantic models read it: null is the default, 2.0 is 2,
    a boolean is not a number; out of lo..hi a 400 naming the field."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _is_int(v) or v < lo or (hi is not None and v > hi):
        rng = f"an integer in {lo}..{hi}" if hi is not None else f"an integer >= {lo}"
        raise bad(name, f"{json.dumps(v)[:40]} is invalid: allowed {rng}")
    return v


def number_field(body: dict, name: str, default: float) -> Any:
    """A number field as vLLM's pydantic models read it: null is the default, a boolean
    or a string is not a number (`SamplingParams` checks its range)."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(name, f"{json.dumps(v)[:40]} is invalid: allowed a number")
    return v


def _flag(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(name, f"{json.dumps(v)[:40]} is invalid: allowed true or false")
    return v


def _common(body: dict, known: set[str]) -> dict:
    """Checks shared by both endpoints → the SamplingRequest fields other than the prompt."""
    for name in body:
        if name in _NOOP_FIELDS:
            if not asks_nothing(body[name], _NOOP_FIELDS[name]):
                allowed = " or ".join(json.dumps(v) for v in _NOOP_FIELDS[name])
                raise bad(name, f"{json.dumps(body[name])[:60]} is not supported by jlco "
                                f"(allowed: {allowed}, or leave it out)")
        elif name not in known and name not in _FREE_FIELDS:
            raise bad(name, "unknown field")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "must be a string")
    # The sampling values themselves are checked by `SamplingParams` (`params`): here
    # only JSON's null and vLLM's top_k -1 ("off", the engine's 0) become its defaults.
    temperature = _or_default(body.get("temperature"), 1.0)
    top_p = _or_default(body.get("top_p"), 1.0)
    top_k = _whole(_or_default(body.get("top_k"), 0))
    top_k = 0 if _is_int(top_k) and top_k == -1 else top_k
    # seed is the server's to read: it adds j to it for choice j of n
    seed = int_field(body, "seed", None, 0, 2 ** 32 - 1)
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) \
            or len(stop) > MAX_STOP_STRINGS:
        raise bad("stop", f"allowed a non-empty string or a list of at most {MAX_STOP_STRINGS} "
                          "non-empty strings")
    stop_ids = body.get("stop_token_ids") or []
    stop_ids = [_whole(t) for t in stop_ids] if isinstance(stop_ids, list) else stop_ids
    if not isinstance(stop_ids, list) or not all(_is_int(t) and t >= 0 for t in stop_ids):
        raise bad("stop_token_ids", "allowed a list of token ids (integers >= 0)")
    flags = {name: _flag(body, name) for name in
             ("ignore_eos", "stream", "return_token_ids", "include_stop_str_in_output")}
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise bad("stream_options", "allowed an object with include_usage (bool)")
        if not flags["stream"]:
            raise bad("stream_options", "only allowed when stream is true")
        include_usage = opts.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise bad("stream_options.include_usage", "allowed true or false")
    return dict(model=model, temperature=temperature, top_p=top_p,
                n=int_field(body, "n", 1, 1, MAX_N), top_k=top_k, seed=seed, stop=tuple(stop),
                stop_token_ids=tuple(stop_ids), include_usage=include_usage,
                penalties=_penalties(body), min_p=number_field(body, "min_p", 0.0),
                structured=_structured(body), **flags)


def _structured(body: dict) -> GrammarSpec | None:
    try:
        return read_structured(body)
    except FieldError as err:
        raise bad(err.field, str(err)) from None


def _penalties(body: dict) -> Penalties:
    """The penalty and bias fields (null: the default); their ranges are the engine's
    to check. logit_bias: {"token id": bias}, OpenAI's map with string keys."""
    bias = _or_default(body.get("logit_bias"), {})
    if not isinstance(bias, dict):
        raise bad("logit_bias", "allowed an object mapping token ids to numbers in -100..100")
    pairs = []
    for key, v in bias.items():
        if not (isinstance(key, str) and key.strip().isdigit()):
            raise bad("logit_bias", f"key {json.dumps(key)[:40]} is not a token id")
        pairs.append((int(key), v))
    return Penalties(presence=number_field(body, "presence_penalty", 0.0),
                     frequency=number_field(body, "frequency_penalty", 0.0),
                     repetition=number_field(body, "repetition_penalty", 1.0),
                     min_tokens=int_field(body, "min_tokens", 0, 0),
                     logit_bias=tuple(pairs))


def _max_tokens(body: dict, name: str, default: int | None, lo: int = 1) -> int | None:
    return int_field(body, name, default, lo)


_SAMPLING = {"model", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
             "ignore_eos", "stream", "stream_options", "return_token_ids",
             "include_stop_str_in_output", "n", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "min_p", "min_tokens", "logit_bias", "response_format",
             "structured_outputs"}


# The fields each endpoint implements (besides the no-op and informational ones above);
# jlco.server.schema declares exactly these, tests/server/test_api_schema.py holds it to.
COMPLETION_FIELDS = _SAMPLING | {"prompt", "max_tokens", "kv_transfer_params", "logprobs",
                                 "echo"}
CHAT_FIELDS = _SAMPLING | {"messages", "max_tokens", "max_completion_tokens",
                           "add_generation_prompt", "chat_template_kwargs", "logprobs",
                           "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
                           "reasoning_effort"}
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
NOOP_FIELDS, FREE_FIELDS = _NOOP_FIELDS, _FREE_FIELDS


def parse_completion(body: dict) -> SamplingRequest:
    """POST /v1/completions → SamplingRequest, or an ApiError naming the field."""
    known = COMPLETION_FIELDS
    if "prompt" not in body:
        raise bad("prompt", "required: a string or a list of token ids")
    prompts = _prompts(body["prompt"])
    common = _common(body, known)
    echo = _flag(body, "echo")
    logprobs = int_field(body, "logprobs", None, 0, MAX_LOGPROBS)
    req = SamplingRequest(prompt_text=prompts[0][0], prompt_ids=prompts[0][1],
                          max_tokens=_max_tokens(body, "max_tokens", DEFAULT_MAX_TOKENS,
                                                 0 if echo else 1),
                          prefill_id=_prefill_id(body.get("kv_transfer_params")),
                          logprobs=logprobs, echo=echo, more_prompts=tuple(prompts[1:]),
                          **common)
    if req.prefill_id is not None and (len(prompts) > 1 or req.n > 1 or echo):
        raise bad("kv_transfer_params", "a claimed prefill is one prompt, n 1, without echo")
    return req


def _prefill_id(v: Any) -> int | None:
    """kv_transfer_params (vLLM's name for PD hand-over fields): {"prefill_id": "pf-N"}
    as returned by POST /v1/internal/prefilled."""
    if v is None:
        return None
    pid = v.get("prefill_id") if isinstance(v, dict) and set(v) == {"prefill_id"} else None
    if not isinstance(pid, str) or not pid.startswith("pf-") or not pid[3:].isdigit():
        raise bad("kv_transfer_params", "allowed {\"prefill_id\": \"pf-N\"} as returned by "
                                        "POST /v1/internal/prefilled")
    return int(pid[3:])


def parse_chat(body: dict) -> tuple[SamplingRequest, list[dict], bool]:
    """POST /v1/chat/completions → (SamplingRequest without prompt, messages,
    add_generation_prompt). `max_completion_tokens` (OpenAI's newer name) wins over
    `max_tokens`; neither: up to the context limit."""
    msgs = parse_messages(body.get("messages"))
    add_gen = body.get("add_generation_prompt", True)
    if not isinstance(add_gen, bool):
        raise bad("add_generation_prompt", "allowed true or false")
    kwargs = _or_default(body.get("chat_template_kwargs"), {})
    if not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", "allowed an object (the chat template's variables)")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad("reasoning_effort", f"allowed one of {REASONING_EFFORTS}")
        kwargs = {"thinking": effort != "none", **kwargs}
    common = _common(body, CHAT_FIELDS)
    try:
        tools = read_tools(body)
    except FieldError as err:
        raise bad(err.field, str(err)) from None
    if tools is not None and tools.forced:
        if common["structured"] is not None:
            raise bad("tool_choice", "a forced tool call cannot also take response_format "
                                     "or structured_outputs")
        common["structured"] = tools.grammar()
    max_tokens = _max_tokens(body, "max_completion_tokens", None) or \
        _max_tokens(body, "max_tokens", None)
    top = int_field(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top and not _flag(body, "logprobs"):
        raise bad("top_logprobs", "needs logprobs: true")
    logprobs = (top or 0) if _flag(body, "logprobs") else None
    req = SamplingRequest(prompt_text=None, prompt_ids=None, max_tokens=max_tokens,
                          logprobs=logprobs, tools=tools, template_kwargs=kwargs, **common)
    return req, msgs, add_gen


def parse_messages(msgs: Any) -> list[dict]:
    """A chat's `messages` → a copy with text-part contents joined, or a 400 naming the
    message and field."""
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "required: a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise bad(f"messages[{i}].role", "required: a non-empty string")
        content = m.get("content")
        if isinstance(content, list):       # OpenAI content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise bad(f"messages[{i}].content", "allowed a string or a list of "
                                                    "{\"type\": \"text\", \"text\"} parts")
            m = dict(m, content="".join(p["text"] for p in content))
        elif content is None and m.get("tool_calls"):
            pass                            # an assistant turn that only called tools
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content", "required: a string")
        _check_calls(m.get("tool_calls"), i)
        out.append(dict(m))
    return out


def _check_calls(calls: Any, i: int) -> None:
    """An assistant message's `tool_calls`: [{"id", "type": "function", "function":
    {"name", "arguments": JSON text}}]."""
    if calls is None:
        return
    ok = isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict)
        and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments"), str) for c in calls)
    if not ok:
        raise bad(f"messages[{i}].tool_calls", "allowed a list of {\"id\", \"type\": "
                  "\"function\", \"function\": {\"name\", \"arguments\": str}}")


@dataclasses.dataclass(frozen=True)
class TokenizeRequest:
    """POST /tokenize: a text prompt, or a chat's messages to render first."""
    prompt: str | None
    messages: list[dict] | None
    add_special_tokens: bool       # text: the tokenizer's BOS rule; chat: none unless asked
    add_generation_prompt: bool
    model: str | None


def parse_tokenize(body: dict) -> TokenizeRequest:
    """vLLM's tokenize bodies: {"prompt": str} or {"messages": [...]}, optional
    add_special_tokens (default true for a prompt, false for a chat, as vLLM) and, for a
    chat, add_generation_prompt (default true)."""
    chat = "messages" in body
    known = {"model", "add_special_tokens"} | (
        {"messages", "add_generation_prompt"} if chat else {"prompt"})
    for name in body:
        if name not in known:
            raise bad(name, "unknown field" if name not in ("prompt", "messages") else
                      "send either prompt or messages, not both")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "must be a string")
    special = body.get("add_special_tokens")
    special = (not chat) if special is None else special
    if not isinstance(special, bool):
        raise bad("add_special_tokens", "allowed true or false")
    if chat:
        add_gen = body.get("add_generation_prompt", True)
        if not isinstance(add_gen, bool):
            raise bad("add_generation_prompt", "allowed true or false")
        return TokenizeRequest(None, parse_messages(body["messages"]), special, add_gen, model)
    if not isinstance(body.get("prompt"), str):
        raise bad("prompt", "required: a string (or \"messages\": a chat)")
    return TokenizeRequest(body["prompt"], None, special, False, model)


def parse_detokenize(body: dict) -> tuple[list[int], str | None]:
    """vLLM's detokenize body {"tokens": [ids], "model"?} → (ids, model)."""
    for name in body:
        if name not in ("tokens", "model"):
            raise bad(name, "unknown field")
    toks = body.get("tokens")
    toks = [_whole(t) for t in toks] if isinstance(toks, list) else toks
    if not isinstance(toks, list) or not all(_is_int(t) and t >= 0 for t in toks):
        raise bad("tokens", "required: a list of token ids (integers >= 0)")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "must be a string")
    return toks, model
