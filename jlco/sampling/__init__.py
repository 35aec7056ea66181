"""How a request samples, from the parameters it brings to the draw inside the step:
`params` (`SamplingParams`, one frozen value per request, checked once, and
`MAX_LOGPROBS`), `errors` (`RequestError`: how a request is refused, naming the field),
`penalties` (the penalty and bias fields and their check), `penalize` (the per-slot
penalty tables on the device and how a step applies them), `constraint` (token masks of
constrained decoding) and `sample` (the per-slot sampling pytree, the filters, the draw,
log-probs and speculative verification).

May import `jlco.util` and jax / numpy only; the engine, the structured outputs and the
server build on it. `params`, `errors` and `penalties` import no jax (the scheduler loads
them), so this file imports nothing eagerly.
"""
