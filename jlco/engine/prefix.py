"""Prefix reuse: the full pages of finished prefills kept in host memory, so a prompt that
starts with one already seen (the next turn of a chat or an agent session) prefills only
the rest.

A page of `cache.page_size` positions is named by the hash chain of the token ids up to
its end (vLLM's block hashes). Its entry holds copies of everything a prefill leaves in
the one-request cache for those positions: every cache layer's latent rows, indexer keys
(and fp8 scales). Entries are copies, not shared host-pool pages, for three reasons: the
indexer keys (and, with the cache on the device, the latent rows) have no host home of
their own; nothing a running request writes (speculative decoding rewrites the MTP row of
the prompt's last position at its first step) can reach a cached page; and admission is
never held by cached pages (the pool's pages go back when their request ends). The price
is host memory: `cache.prefix_cache_tokens` bounds it, least recently used pages go first,
a prefix's tail pages before its head.

Exact by construction. A prompt's pieces are fixed by position (`jlco.util.buckets.
prompt_pieces`), so a longer prompt computes a shared prefix in the same pieces as the
prompt that cached it, with the same float reduction order. An entry records the pieces
(lo, width) that computed it and is reused only where the new prompt's pieces are the
same; the prefill resumes at a piece boundary of the new prompt (at least one piece is
always computed: it yields the first token's logits). With MTP, the MTP layer's row of a
prompt's last position was computed without its follower token; when a page ends there,
its entry keeps the final hidden states of the piece that ends there, and a reuse that
resumes at that page's end recomputes the MTP block of that piece with the follower
(`jlco.engine.speculative.mtp_fixup`), as the no-reuse prefill computes it.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from functools import partial
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 1024   # positions per load / read call (one compiled shape each)


@dataclasses.dataclass(frozen=True)
class PageEntry:
    """One cached page: per cache layer its rows, keys and scales, stacked on layers."""
    latent: np.ndarray                 # uint8 [L, page, row_bytes]
    index_k: np.ndarray                # [L', page, D] as the cache stores keys; L' =
    index_scale: np.ndarray | None     # f32 [L', page] (fp8)  layers with keys (`_keyed`)
    pieces: tuple[tuple[int, int], ...]    # (lo, width) of the pieces that computed it
    fix: tuple[int, np.ndarray] | None = None  # MTP: (piece lo, hidden [width, d])

    @property
    def nbytes(self) -> int:
        fix = 0 if self.fix is None else self.fix[1].nbytes
        scale = 0 if self.index_scale is None else self.index_scale.nbytes
        return self.latent.nbytes + self.index_k.nbytes + scale + fix


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """What a new prompt reuses: `tokens` positions (a piece boundary; the prefill
    resumes there), their pages' entries, and the MTP fix-up for the piece ending there."""
    tokens: int
    entries: tuple[PageEntry, ...] = ()
    fix: tuple[int, np.ndarray] | None = None


def page_hashes(prompt: Sequence[int], page_size: int) -> list[bytes]:
    """The hash chain of each full page of `prompt` (page j: tokens 0 .. (j+1)·page)."""
    ids = np.asarray(prompt, np.int64)
    out, prev = [], b""
    for j in range(len(ids) // page_size):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(ids[j * page_size:(j + 1) * page_size].tobytes())
        prev = h.digest()
        out.append(prev)
    return out


def pieces_over(pieces, a: int, b: int) -> tuple[tuple[int, int], ...]:
    """(lo, width) of the pieces (lo, hi, width) that compute positions a .. b-1."""
    return tuple((lo, w) for lo, hi, w in pieces if lo < b and hi > a)


class PrefixCache:
    """The cached pages of one engine, LRU, at most `capacity` pages. `mtp`: the cache
    has an MTP layer (its last-position rows need the fix-up above)."""

    def __init__(self, page_size: int, capacity: int, mtp: bool):
        self.page_size, self.capacity, self.mtp = page_size, capacity, mtp
        self._pages: collections.OrderedDict[bytes, PageEntry] = collections.OrderedDict()
        self.queries = 0   # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0      # of them, reused
        self.bytes = 0

    def match(self, prompt: Sequence[int], pieces) -> PrefixHit:
        """The longest reusable prefix of `prompt`, whose pieces are `pieces`
        (`prompt_pieces`); counts the lookup."""
        n, ps = len(prompt), self.page_size
        valid, entries = 0, []
        for j, h in enumerate(page_hashes(prompt[:n - 1], ps)):
            e = self._pages.get(h)
            if e is None or e.pieces != pieces_over(pieces, j * ps, (j + 1) * ps):
                break
            entries.append(e)
            valid = (j + 1) * ps
            if e.fix is not None:
                break
        resume = max((lo for lo, _, _ in pieces if lo <= valid and lo % ps == 0), default=0)
        entries = entries[:resume // ps]
        fix = entries[-1].fix if entries and (len(entries) * ps == valid) else None
        self.queries += n
        self.hits += resume
        return PrefixHit(resume, tuple(entries), fix if resume == valid else None)

    def insert(self, prompt: Sequence[int], pieces, first: int,
               read: Callable[[int, int], tuple], fix: tuple[int, np.ndarray] | None) -> int:
        """Cache the full pages of a finished prefill from page `first` on (those before
        came from the cache); `read(lo, hi)` returns (latent [L, hi-lo, row], keys,
        scales) of the prefill's cache at positions lo..hi-1. `fix`: MTP fix-up data for
        a page that ends at the prompt's end (None: that page is not cached when the
        cache has an MTP layer). → pages added. Touches the prompt's pages last to first,
        so eviction takes a prefix's tail before its head."""
        ps, n = self.page_size, len(prompt)
        hashes = page_hashes(prompt, ps)
        if self.mtp and n % ps == 0 and fix is None:
            hashes = hashes[:-1]
        need = [j for j in range(first, len(hashes)) if not self._fresh(
            hashes[j], pieces_over(pieces, j * ps, (j + 1) * ps))]
        added = 0
        if need:
            lat, keys, scales = read(need[0] * ps, (need[-1] + 1) * ps)
            for j in need:
                a = (j - need[0]) * ps
                last = self.mtp and (j + 1) * ps == n
                e = PageEntry(lat[:, a:a + ps].copy(), keys[:, a:a + ps].copy(),
                              None if scales is None else scales[:, a:a + ps].copy(),
                              pieces_over(pieces, j * ps, (j + 1) * ps), fix if last else None)
                self._put(hashes[j], e)
                added += 1
        for h in reversed(hashes):
            if h in self._pages:
                self._pages.move_to_end(h)
        self._evict()
        return added

    def _fresh(self, h: bytes, sig) -> bool:
        """The page is cached as this prefill computed it (same pieces, no fix-up left);
        otherwise this prefill's copy replaces it (a longer prompt's pieces are the ones
        later, longer prompts share)."""
        e = self._pages.get(h)
        return e is not None and e.fix is None and e.pieces == sig

    def _put(self, h: bytes, e: PageEntry) -> None:
        old = self._pages.pop(h, None)
        if old is not None:
            self.bytes -= old.nbytes
        self._pages[h] = e
        self.bytes += e.nbytes

    def _evict(self) -> None:
        while len(self._pages) > self.capacity:
            _, e = self._pages.popitem(last=False)
            self.bytes -= e.nbytes

    def reset(self, counters: bool = False) -> int:
        """Drop every cached page (`counters`: zero the lookup counters too) → how many."""
        n = len(self._pages)
        self._pages.clear()
        self.bytes = 0
        if counters:
            self.queries = self.hits = 0
        return n

    def stats(self) -> dict:
        return {"queries": self.queries, "hits": self.hits, "pages": len(self._pages),
                "bytes": self.bytes}


# ---- between cached pages and a one-request device cache ------------------------------

def _keyed(arrs) -> list:
    """The per-layer arrays that hold data: a layer that shares its top-k (IndexShare)
    keeps zero-width keys and scales, which a page entry does not store (its keys and
    scales stack the other layers only)."""
    return [a for a in arrs if a.size]


def _block_positions(at, max_len: int):
    return at + jnp.arange(min(BLOCK, max_len), dtype=jnp.int32)


@partial(jax.jit, donate_argnums=(0,))
def _load_block(cache, latent, keys, scales, at):
    """Rows of positions at .. at+BLOCK-1 (past max_len dropped) into a [1, t] cache."""
    pos = _block_positions(at, cache.max_len)

    def put(arrs, vals):     # vals: one per layer with keys (`_keyed`)
        vals = iter(vals)
        return tuple(a.at[0, pos].set(next(vals), mode="drop") if a.size else a for a in arrs)
    return dataclasses.replace(
        cache, latent=put(cache.latent, latent), index_k=put(cache.index_k, keys),
        index_scale=None if scales is None else put(cache.index_scale, scales))


@jax.jit
def _read_block(cache, at):
    """(latent [L, BLOCK, row], keys [L, BLOCK, D], scales) at positions at .. of a
    [1, t] cache (positions past max_len clipped)."""
    pos = jnp.minimum(_block_positions(at, cache.max_len), cache.max_len - 1)

    def get(arrs):
        return None if arrs is None else jnp.stack([a[0, pos] for a in _keyed(arrs)])
    return get(cache.latent), get(cache.index_k), get(cache.index_scale)


def load(cache, hit: PrefixHit, page_size: int):
    """A fresh one-request cache with `hit`'s pages at positions 0 .. hit.tokens - 1
    and its length set there."""
    e0 = hit.entries[0]
    block = min(BLOCK, cache.max_len)
    per = block // page_size
    for b0 in range(0, len(hit.entries), per):
        part = hit.entries[b0:b0 + per]

        def stack(field):
            vals = [getattr(e, field) for e in part]
            out = np.zeros((getattr(e0, field).shape[0], block) + getattr(e0, field).shape[2:],
                           getattr(e0, field).dtype)
            out[:, :len(vals) * page_size] = np.concatenate(vals, axis=1)
            return tuple(out)
        scales = None if e0.index_scale is None else stack("index_scale")
        cache = _load_block(cache, stack("latent"), stack("index_k"), scales,
                            jnp.int32(b0 * page_size))
    return dataclasses.replace(cache, lengths=jnp.full((1,), hit.tokens, jnp.int32))


def reader(cache):
    """`PrefixCache.insert`'s `read` over a finished prefill's one-request cache."""
    def read(lo: int, hi: int):
        from jlco.engine.prefill import to_host
        parts = [to_host(_read_block(cache, jnp.int32(at))) for at in range(lo, hi, BLOCK)]
        lat, keys, scales = (None if parts[0][i] is None else
                             np.concatenate([p[i] for p in parts], axis=1)[:, :hi - lo]
                             for i in range(3))
        return lat, keys, scales
    return read


def payload_reader(p):
    """`PrefixCache.insert`'s `read` over an imported prefill (`transfer.PrefilledRequest`,
    computed by the same pieces on the prefill node)."""
    def read(lo: int, hi: int):
        scales = None if p.index_scale is None else np.stack(
            [a[lo:hi] for a in _keyed(p.index_scale)])
        return (np.stack([a[lo:hi] for a in p.latent]),
                np.stack([a[lo:hi] for a in _keyed(p.index_k)]), scales)
    return read


# ---- the runner's side ------------------------------------------------------------------

def open_prefix(cfg) -> PrefixCache | None:
    """The engine's prefix cache (`cache.prefix_cache`), None when off."""
    from jlco.engine.allocation import prefix_pages
    if not cfg.cache.prefix_cache:
        return None
    mtp = bool(cfg.engine.num_draft_tokens) and cfg.model.num_nextn_predict_layers > 0
    return PrefixCache(cfg.cache.page_size, prefix_pages(cfg), mtp)


def open_job_cache(prefix: PrefixCache | None, cfg, job, model, impl: str):
    """A job's one-request cache when its first piece runs: matched against `prefix`
    (None: off) then (`PrefillJob.reuse`; the request reports `cached_tokens`), holding the
    reused prefix, with the MTP fix-up of the piece that ends it when the cached prompt
    ended there (model: the split (graphdef, state)); empty without a hit."""
    from jlco.engine import prefill as engine_prefill
    if prefix is not None and job.req.params.prompt_logprobs is None:   # echo: all rows
        job.reuse(prefix.match(job.req.prompt, job.pieces))
        job.req.cached_tokens = job.resume
    cache = engine_prefill.open_cache(cfg, job.max_len)
    if job.hit is None:
        return cache
    cache = load(cache, job.hit, cfg.cache.page_size)
    if job.hit.fix is not None:
        from jlco.engine.speculative import mtp_fixup
        lo, hidden = job.hit.fix
        cache = mtp_fixup(model, cache, job.tokens, lo, hidden, impl=impl)
    return cache


def cache_job(prefix: PrefixCache | None, cfg, job) -> None:
    """A finished prefill's full pages into `prefix` (None: off) (those it computed,
    and a fixed-up page before them); with MTP, a page ending at the prompt's end keeps
    its piece's hidden states for the fix-up."""
    from jlco.engine import prefill as engine_prefill
    if prefix is None:
        return
    ps, n = cfg.cache.page_size, len(job.req.prompt)
    fix = None
    if prefix.mtp and n % ps == 0 and job.piece_hidden is not None:
        lo, _, width = job.pieces[-1]
        from jlco.engine.prefill import to_host
        fix = (lo, to_host(job.piece_hidden)[0, :width])
    first = job.resume // ps - (job.hit is not None and job.hit.fix is not None)
    prefix.insert(job.req.prompt, engine_prefill.pieces(cfg, n), max(first, 0),
                  reader(job.cache), fix)
    job.piece_hidden = None


def cache_import(prefix: PrefixCache | None, cfg, p) -> None:
    """An imported prefill's pages into `prefix` (None: off). Its rows were computed by the
    prefill node's pieces: the same as here when both run one config (as PD's
    bit-equality already requires)."""
    from jlco.engine import prefill as engine_prefill
    if prefix is None:
        return
    prefix.insert(p.prompt, engine_prefill.pieces(cfg, len(p.prompt)), 0, payload_reader(p),
                  None)
