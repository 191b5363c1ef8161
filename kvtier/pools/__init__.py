"""Memory pools: what a model stores per token (``PoolSpec``), the page allocator, the device
(L1) pool and the host (L2) pool."""

from kvtier.pools.allocator import PageAllocator
from kvtier.pools.device import DevicePool
from kvtier.pools.host import HostPool
from kvtier.pools.spec import PoolSpec

__all__ = ["DevicePool", "HostPool", "PageAllocator", "PoolSpec"]
