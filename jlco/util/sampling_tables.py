"""The fixed widths of the per-slot sampling tables the engine keeps on the device
(`jlco.sampling.penalize.SeenTokens`), and their bytes, in one place: the engine allocates
them, the request check enforces the widths, the planner counts the bytes per slot."""

MAX_LOGIT_BIAS = 300    # biased tokens per request (OpenAI's documented cap)
MAX_HELD_STOPS = 64     # stop token ids min_tokens holds back per request


def penalty_table_bytes(vocab: int) -> int:
    """Device bytes of one slot's tables: generated-token counts int32 [V], prompt
    membership bool [V], the bias ids int32 and values f32 [MAX_LOGIT_BIAS], the held
    stop ids int32 [MAX_HELD_STOPS], presence / frequency / repetition f32, min_tokens
    int32 and the slot's on flag."""
    return 5 * vocab + 8 * MAX_LOGIT_BIAS + 4 * MAX_HELD_STOPS + 4 * 4 + 1
