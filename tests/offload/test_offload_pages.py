"""Host page allocator: ownership, release on finish/abort, HostPoolFull, no leaks."""
import chex
import numpy as np
import pytest

from jlco.offload.pages import HostPoolFull, PageAllocator, PageLeakError


def test_reserve_grows_and_release_returns_everything():
    a = PageAllocator(num_pages=10, page_size=4)
    assert a.reserve("r1", 5) == (0, 1)
    assert a.reserve("r2", 4) == (2,)
    assert a.reserve("r1", 8) == (0, 1)          # total, idempotent
    assert a.reserve("r1", 9) == (0, 1, 3)       # grows by one page
    assert (a.used_pages, a.free_pages) == (4, 6)
    assert a.owner_of(3) == "r1" and a.owner_of(2) == "r2" and a.owner_of(9) is None
    a.check(expect_requests={"r1", "r2"})
    assert a.release("r1") == 3
    assert a.release("r2") == 1
    assert a.release("r2") == 0                  # abort after finish: no-op
    assert (a.used_pages, a.free_pages) == (0, 10)
    a.check(expect_requests=set())


def test_abort_mid_decode_frees_all_pages_and_they_are_reused():
    a = PageAllocator(8, 2)
    for i in range(4):
        a.reserve(i, 3)
    a.release(2)                                  # abort
    assert a.pages_of(2) == () and a.free_pages == 2
    assert a.reserve("new", 4) == (4, 5)          # lowest free pages first
    for rid in (0, 1, 3, "new"):
        a.release(rid)
    a.check(expect_requests=())
    assert a.used_pages == 0


def test_host_pool_full_names_request_and_counts_and_changes_nothing():
    a = PageAllocator(4, 16)
    a.reserve("a", 48)
    with pytest.raises(HostPoolFull, match=r"'b' needs 2 more page\(s\).*only 1 of 4 are free"):
        a.reserve("b", 20)
    assert a.requests == ("a",) and a.free_pages == 1
    with pytest.raises(HostPoolFull, match="'a' needs 2 more"):
        a.reserve("a", 80)
    assert a.pages_of("a") == (0, 1, 2)
    a.check(expect_requests={"a"})


def test_page_table_layout_and_errors():
    a = PageAllocator(6, 4)
    a.reserve("x", 9)
    a.reserve("y", 1)
    t = a.page_table(["x", None, "y"], max_pages=4)
    assert t.dtype == np.int32
    chex.assert_trees_all_equal(t, np.asarray([[0, 1, 2, -1], [-1] * 4, [3, -1, -1, -1]]))
    with pytest.raises(ValueError, match="max_pages=2"):
        a.page_table(["x"], max_pages=2)
    with pytest.raises(KeyError, match="'z'"):
        a.page_table(["z"], 4)


def test_check_detects_a_leak_and_bad_arguments():
    a = PageAllocator(4, 4)
    a.reserve("x", 4)
    a._free.append(0)                             # simulate a double free
    with pytest.raises(PageLeakError):
        a.check()
    with pytest.raises(ValueError, match="num_pages=0"):
        PageAllocator(0, 4)
    with pytest.raises(ValueError, match="num_tokens"):
        PageAllocator(2, 2).reserve("q", -1)
    with pytest.raises(ValueError, match="request_id=None"):
        PageAllocator(2, 2).reserve(None, 1)
