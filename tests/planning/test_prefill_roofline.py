"""jlco.planning.roofline.prefill_cost: a whole prompt's prefill, piece by piece as the
engine runs it, checked against counts made by hand on a tiny config, and its piece and
scan-bucket shapes against the engine's own."""
import dataclasses

import pytest

from jlco.engine.prefill import MIN_PIECE, WARMUP_QUERIES, pieces
from jlco.util.buckets import piece_grid
from jlco.model.kv_cache import scan_bucket
from jlco.planning import roofline
from tests.tools.test_roofline import tiny


def test_shapes_are_the_engines():
    assert (roofline.WARMUP_QUERIES, roofline.MIN_PIECE) == (WARMUP_QUERIES, MIN_PIECE)
    for n in (1, 5, 31, 32, 33, 100, 4096, 5000, 131072):
        for chunk, page in ((16, 4), (64, 16), (4096, 64)):
            cfg = tiny().replace(engine__prefill_chunk=chunk, cache__page_size=page)
            assert roofline.prefill_pieces(n, chunk, piece_grid(page, chunk)) == \
                pieces(cfg, n), (n, chunk)
    for n, max_len in ((1, 64), (1024, 4096), (1025, 4096), (3000, 4096), (131072, 135168),
                       (4097, 8192)):
        want = scan_bucket(n, max_len)
        assert roofline.scan_positions(n, max_len) == (max_len if want is None else want)


def test_hand_count():
    """40 tokens, chunk 16, grid 4: pieces (0,16), (16,32) 16 wide, (32,36), (36,40) 4
    wide; cache of 64 positions, so every piece scans all 64."""
    cfg = tiny()
    p = roofline.prefill_cost(cfg, 40, chunk=16, grid=4)
    assert p.pieces == ((0, 16, 16), (16, 32, 16), (32, 36, 4), (36, 40, 4))
    assert p.scans == (64,) * 4
    by, fl = p.by_part()
    # Per token: 1600 matmul params, of which lm_head 128 runs once per piece (4 pieces).
    # Indexer 2 layers x 2 heads x 4 dims: q at position i sees i + 1 keys (sum 820).
    # Sparse MLA 2 layers x 2 heads x (10 + 8): min(top-k 3, i + 1) rows (1+2+3x38 = 117).
    assert fl == dict(matmul=2 * 1472 * 40 + 2 * 128 * 4,
                      indexer_scores=2 * 2 * 2 * 4 * 820,
                      sparse_mla=2 * 2 * 2 * 18 * 117)
    assert by["index_keys"] == 2 * 8 * (0 + 16 + 32 + 36)   # keys cached before each piece
    assert by["latent_rows"] == 2 * 117 * 20
    assert by["cache_writes"] == 2 * 40 * (20 + 8)
    assert by["embed"] == 40 * 8 * 2
    assert by["lm_head"] == 4 * 16 * 8 * 2                 # weights: once per piece
    assert by["attention"] == 4 * 2 * 352 * 2
    assert by["routed_experts"] == 4 * 4 * 96 * 2          # every piece touches all 4
    # As run: 40 queries (16 + 16 + 4 + 4), each scoring 64 keys, gathering 3 rows.
    rb, rf = p.by_part(as_run=True)
    assert rf == dict(matmul=2 * 1472 * 40 + 2 * 128 * 4,
                      indexer_scores=2 * 2 * 2 * 4 * 40 * 64,
                      sparse_mla=2 * 2 * 2 * 18 * 40 * 3)
    assert rb["index_keys"] == 4 * 2 * 64 * 8
    assert rb["latent_rows"] == 2 * 40 * 3 * 20
    assert rb["cache_writes"] == 2 * 40 * 28
    assert rb["lm_head"] == by["lm_head"] and rb["attention"] == by["attention"]
    assert p.total_flops() == sum(fl.values()) < p.total_flops(as_run=True)


def test_one_token_is_a_decode_step_on_nothing():
    cfg = tiny()
    p = roofline.prefill_cost(cfg, 1)
    assert p.pieces == ((0, 1, 64),)   # the page grid of page_size 64
    one = roofline.decode_step_cost(cfg, 1, 0)
    assert p.useful[0].bytes == one.bytes and p.useful[0].flops == one.flops


def test_scan_buckets_grow_with_the_prompt():
    """max_len 4096, 1500 tokens in chunks of 1024, grid 256: pieces end at 1024, 1280,
    1536 (padded), so the indexer scans 1024, then 2048 keys per query."""
    cfg = tiny()
    cfg = cfg.replace(model=dataclasses.replace(cfg.model, max_position_embeddings=4096),
                      engine__max_context_len=4096)
    p = roofline.prefill_cost(cfg, 1500, chunk=1024, grid=256)
    assert p.pieces == ((0, 1024, 1024), (1024, 1280, 256), (1280, 1500, 256))
    assert p.scans == (1024, 2048, 2048)
    rb, rf = p.by_part(as_run=True)
    assert rb["index_keys"] == 2 * 8 * (1024 + 2048 + 2048)
    assert rf["indexer_scores"] == 2 * 2 * 2 * 4 * (1024 * 1024 + 256 * 2048 + 256 * 2048)


def test_time_is_the_sum_of_the_pieces():
    cfg = tiny()
    p = roofline.prefill_cost(cfg, 40, chunk=16, grid=4)
    m = roofline.Machine("toy", mem_bw=1000.0, peak_flops=1000.0)
    assert p.time_s(m) == sum(max(s.total_bytes, s.total_flops) / 1000.0 for s in p.useful)
    # Compute-bound pieces here: the sum equals the whole prefill's FLOPs / peak.
    assert p.time_s(m) == pytest.approx(max(p.total_bytes(), p.total_flops()) / 1000.0)
    d = p.as_dict(m)
    assert d["useful"]["time_s"] == p.time_s(m)
    assert d["as_run"]["total_flops"] == p.total_flops(as_run=True)


@pytest.mark.parametrize("kw, match", [
    (dict(prompt_len=0), "prompt_len"), (dict(prompt_len=65), "max_len"),
    (dict(prompt_len=8, chunk=0), "chunk"), (dict(prompt_len=8, grid=0), "grid"),
    (dict(prompt_len=8, chunk=16, grid=32), "grid"),
])
def test_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        roofline.prefill_cost(tiny(), **kw)
