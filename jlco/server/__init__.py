"""The server wing, behind `python -m jlco.serve`: `protocol` (OpenAI/vLLM request fields
validated, the error shape), `loop` (the engine thread: one thread owns the Engine,
handlers talk to it through a command queue and per-request streams), `app` (the
FastAPI routes, SSE streaming, API key, health, PD import/export), `metrics`
(Prometheus), `text` (tokenizers, incremental detokenization with stop strings, chat
templates). The operators' HTTP clients of a server (load generation, `jlco.validate`,
`jlco.diagnose`) live in `jlco.ops`.

May import: `jlco.engine`, `jlco.config`, `jlco.model.kv_cache`, `jlco.util` and the
libraries of serving (fastapi, prometheus_client, tokenizers, jinja2); nothing
above it (entry points, tools). This file imports nothing, so `import
jlco.server.protocol` stays light.
"""
