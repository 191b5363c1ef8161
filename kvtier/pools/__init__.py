"""Memory pools: what a model stores per token (``PoolSpec``), the page allocator, the device
(L1) pool (per-component buffers, or one relocatable arena: ``UnifiedPool``) and the host (L2)
pool.

Units. Two different things are called a page, and every pool size counts the second:

* the **KV page**, ``CacheConfig.page_size`` tokens: the granularity the user configures;
* the **tree page**, ``tree_page_size(page_size, specs)`` tokens: the least common multiple of
  the KV page and every sidecar's ``tokens_per_row``. It equals the KV page unless a sidecar
  groups tokens more coarsely (a 64-token compressed index with 16-token KV pages gives
  64-token tree pages). The radix tree splits on it, the pools allocate it, and one L3 object
  holds one (or, span mode, several consecutive ones).

Sizes, in those units:

==============================  ==============================================================
``CacheConfig.device_pages``    tree pages in the device pool (``DevicePool.num_pages``)
``CacheConfig.host_pages``      tree pages in the host pool (``HostPool.num_pages``)
``CacheConfig.host_bytes``      bytes, rounded down to whole tree pages of every component
``CacheConfig.host_ratio``      host tree pages per device tree page
``CacheConfig.storage_bytes``   bytes of L3 objects, envelope headers included (file backend)
``DevicePool.page_size``        tokens per tree page (not the KV page)
``page_bytes``                  bytes of one tree page summed over every component
==============================  ==============================================================

So with ``page_size=16`` and a 64-token sidecar, ``device_pages=256`` holds 256 * 64 tokens.
"""

from kvtier.pools.allocator import PageAllocator
from kvtier.pools.device import DevicePool
from kvtier.pools.host import HostPool
from kvtier.pools.spec import PoolSpec
from kvtier.pools.unified_pool import UnifiedPool

__all__ = ["DevicePool", "HostPool", "PageAllocator", "PoolSpec", "UnifiedPool"]
