"""Log-probs in the response shapes OpenAI defines, from what the engine recorded on a
request (`Request.logprobs`, `.top_out` per generated token, `.prompt_logprob_out` per
prompt position when the request echoes its prompt).

Values are log-probs of the distribution a token was sampled from before temperature
and the filters: the model's logits after the request's penalties and logit_bias
(`jlco.sampling.penalize`), untempered and unfiltered, their log-softmax. Without
penalties this is vLLM's `logprobs_mode` "raw_logprobs", what an evaluator compares with
another engine; vLLM's "processed_logprobs" would also temper and filter. Completions use the legacy shape (`tokens`, `token_logprobs`,
`top_logprobs` as {token: log-prob}, `text_offset`; with `echo` the prompt comes first,
its first token's entries null); chat the `content` list of {token, logprob, bytes,
top_logprobs}. A token is shown as it decodes alone (its tokenizer piece when that
decodes to nothing: a special token).
"""

from __future__ import annotations


def token_text(codec, tok: int) -> str:
    if codec is None:
        return f"<{tok}>"
    text = codec.decode([tok])
    if text:
        return text
    piece = codec.tokenizer.id_to_token(int(tok)) if hasattr(codec, "tokenizer") else None
    return piece or f"<{tok}>"


def _top_dict(codec, top) -> dict[str, float]:
    out: dict[str, float] = {}
    for tok, lp in top:
        out.setdefault(token_text(codec, tok), lp)
    return out


class CompletionLogprobs:
    """The legacy completions `logprobs` object, built piece by piece (a streamed
    response sends each piece's part; its text offsets continue the earlier ones)."""

    def __init__(self, codec, k: int, offset: int = 0):
        self.codec, self.k, self.offset = codec, k, offset

    def part(self, ids, lps, tops) -> dict:
        """Entries for tokens `ids` with log-probs `lps` (None: none, the first prompt
        token) and alternatives `tops` (lists of (id, log-prob), or None)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tok, lp, top in zip(ids, lps, tops):
            text = token_text(self.codec, tok)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(None if lp is None else
                                       _top_dict(self.codec, (top or [])[:self.k]))
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def prompt(self, req) -> dict:
        """The echoed prompt's entries (`req.prompt_logprob_out`)."""
        rest = req.prompt_logprob_out or []
        return self.part(req.prompt, [None] + [lp for lp, _ in rest],
                         [None] + [top for _, top in rest])

    def generated(self, req, start: int, ids) -> dict:
        """Entries of generated tokens start .. start + len(ids) - 1."""
        end = start + len(ids)
        tops = req.top_out[start:end] if req.params.top_logprobs else [[]] * len(ids)
        return self.part(ids, req.logprobs[start:end], tops)


def join(parts: list[dict]) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for p in parts:
        for key in out:
            out[key] += p[key]
    return out


def chat_logprobs(codec, req, start: int, ids, k: int) -> dict:
    """The chat `logprobs` object of generated tokens start .. start + len(ids) - 1."""
    def entry(tok, lp):
        text = token_text(codec, tok)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}
    content = []
    for j, tok in enumerate(ids):
        i = start + j
        top = req.top_out[i][:k] if k and i < len(req.top_out) else []
        content.append(dict(entry(tok, req.logprobs[i]),
                            top_logprobs=[entry(t, v) for t, v in top]))
    return {"content": content}
