"""The engine's fetch chunk and prefetch depth (`cache.fetch_chunk_rows`,
`cache.prefetch_depth`): the config's value, or for "auto" the value
`jlco.offload.schedule` derives from the transfer path measured once per process
(`jlco.planning.probe.host_transfer`: link rate and fixed cost per chunk, at this
config's row size)."""

from __future__ import annotations

from jlco.config import Config
from jlco.offload.schedule import PrefetchDepth, derive_chunk_rows
from jlco.planning import probe


def link(cfg: Config) -> tuple[float, float]:
    """(bytes/s, seconds of fixed cost per chunk) of this process's host→device path."""
    got = probe.host_transfer(cfg.row_bytes)
    return got["link_gbps"] * 1e9, got["overhead_us"] * 1e-6


def chunk_rows(cfg: Config) -> int:
    """Rows per fetch chunk: `cache.fetch_chunk_rows`, "auto" derived (`derive_chunk_rows`)."""
    rows = cfg.cache.fetch_chunk_rows
    return derive_chunk_rows(cfg.row_bytes, *link(cfg)) if rows == "auto" else rows


def prefetch_depth(cfg: Config, num_layers: int) -> PrefetchDepth:
    """The layer-ahead prefetch's depth for a model of `num_layers` main layers."""
    setting = cfg.cache.prefetch_depth
    bw, cost = link(cfg) if setting == "auto" else (1.0, 1.0)
    return PrefetchDepth(setting, num_layers, cfg.row_bytes, bw, cost)
