"""Latent-cache offload core: host page allocator, host latent pool, device hot buffer
(slot table + LRU/FIFO), the two miss-fetch paths, metrics. See ARCHITECTURE.md."""

from jlco.offload.fetch import (FETCH_PATHS, FetchStats, MissFetcher, fetch_host_driven,
                                fetch_in_jit, gather_host_rows)
from jlco.offload.host_pool import (STORAGES, HostLatentPool, host_compute, host_row_ids,
                                    scatter_to_host)
from jlco.offload.hot_buffer import (POLICIES, HotBuffer, ReferenceCache, Resolution,
                                     check_capacity, clear_requests, gather_slots,
                                     init_hot_buffer, insert_new, insert_slots, resolve,
                                     scatter_rows)
from jlco.offload.metrics import OffloadMetrics
from jlco.offload.pages import HostPoolFull, PageAllocator, PageLeakError

__all__ = [
    "FETCH_PATHS", "FetchStats", "MissFetcher", "fetch_host_driven", "fetch_in_jit",
    "gather_host_rows", "STORAGES", "HostLatentPool", "host_compute", "host_row_ids",
    "scatter_to_host", "POLICIES", "HotBuffer", "ReferenceCache", "Resolution",
    "check_capacity", "clear_requests", "gather_slots", "init_hot_buffer", "insert_new",
    "insert_slots",
    "resolve", "scatter_rows", "OffloadMetrics", "HostPoolFull", "PageAllocator",
    "PageLeakError",
]
