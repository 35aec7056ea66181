"""The operators' tools: HTTP clients of a running `python -m jlco.serve`, kept apart from
the server because they never load a model or build an engine; they start servers as
subprocesses, stream requests and read /metrics. `loadgen` (streaming clients with
TTFT / ITL timing, server start and stop, /metrics scraping; also behind
`tools/bench_serve.py`), `validate` (the offload acceptance run of `python -m
jlco.validate`) and `diagnose` (the troubleshooting answers of `python -m jlco.diagnose`).

May import: `jlco.config`, `jlco.util` and the client libraries (httpx, numpy,
prometheus_client's parser, matplotlib); never `jlco.server`, the engine or the model:
what they know of the server is its HTTP API, its stderr lines and its metric names.
"""
