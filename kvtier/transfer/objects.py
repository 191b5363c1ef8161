"""Host pages ↔ storage object bytes.

One storage page (= one tree page) is stored as a *page object* holding every token-indexed
component (KV and sidecars; in span mode the page spans several KV pages, concatenated) and,
for models with a state pool, a separate *state object* written only where the page's
checkpoint is valid. Per-pool strides are derived from each transfer (slots // keys), not
assumed: token-indexed pools must carry exactly one page's rows per key, state pools any
key-divisible count.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.errors import IntegrityError
from kvtier.pools.host import HostPool
from kvtier.pools.spec import PoolSpec
from kvtier.transfer.translate import IdentityTranslator, PageTranslator


class ObjectCodec:
    """Builds and unpacks objects for one group of components of a host pool.

    Pages passed in (``slots``, ``scatter``) are logical host pages; ``translator`` (default:
    what the cache bound to ``host``, see ``kvtier.transfer.translate``) maps them to the
    physical pages the buffers are indexed by, so ``slots`` are physical rows.
    """

    def __init__(
        self, host: HostPool, specs: Sequence[PoolSpec], translator: PageTranslator | None = None
    ) -> None:
        self.host = host
        self.specs = tuple(specs)
        self.translator = translator or IdentityTranslator()
        self.nbytes = sum(s.page_bytes(host.page_size) for s in specs)
        # A relocatable host arena (not a ``HostPool``) has no fixed page views to lend.
        self._zero_copy = (
            isinstance(host, HostPool) and host.layout == "page_first" and len(self.specs) == 1
        )

    def slots(self, pages: torch.Tensor) -> dict[str, torch.Tensor]:
        """Physical host row indices of logical ``pages`` per component (page-major)."""
        phys = self.translator.host_physical(pages)
        out = {}
        for s in self.specs:
            r = s.rows_per_page(self.host.page_size)
            out[s.name] = (phys.unsqueeze(1) * r + torch.arange(r)).reshape(-1)
        return out

    def strides(self, num_keys: int, slots: dict[str, torch.Tensor]) -> dict[str, int]:
        """Rows per key of each component, derived from the transfer; a mismatch is an error."""
        out = {}
        for s in self.specs:
            n = slots[s.name].numel()
            expect = s.rows_per_page(self.host.page_size)
            if s.token_indexed and n != num_keys * expect:
                raise IntegrityError(
                    f"storage transfer of pool {s.name!r}: {n} rows for {num_keys} keys, "
                    f"expected exactly {expect} per key (storage page = {self.host.page_size} tokens)"
                )
            if not s.token_indexed and (num_keys == 0 or n % num_keys):
                raise IntegrityError(
                    f"storage transfer of state pool {s.name!r}: {n} rows is not divisible by "
                    f"{num_keys} keys"
                )
            out[s.name] = n // num_keys if num_keys else 0
        return out

    def _pages_of(self, num_keys: int, slots: dict[str, torch.Tensor]) -> torch.Tensor:
        self.strides(num_keys, slots)
        first = self.specs[0]
        r = first.rows_per_page(self.host.page_size)
        return slots[first.name].reshape(num_keys, -1)[:, 0] // r

    def gather(self, num_keys: int, slots: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """One contiguous uint8 buffer per key (views into the pool when possible)."""
        pages = self._pages_of(num_keys, slots)
        if self._zero_copy:
            buf = self.host.buffers[self.specs[0].name]
            return [buf[p].reshape(-1).view(torch.uint8) for p in pages.tolist()]
        parts = [
            self.host.read_pages(s.name, pages).reshape(num_keys, -1).view(torch.uint8)
            for s in self.specs
        ]
        return list(torch.cat(parts, dim=1).unbind(0))

    def read_buffers(
        self, num_keys: int, slots: dict[str, torch.Tensor]
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Buffers to read ``num_keys`` objects into, and the staging tensor to ``scatter``
        afterwards (``None``: the buffers are the pool's own memory)."""
        pages = self._pages_of(num_keys, slots)
        if self._zero_copy:
            buf = self.host.buffers[self.specs[0].name]
            return [buf[p].reshape(-1).view(torch.uint8) for p in pages.tolist()], None
        staged = torch.empty((num_keys, self.nbytes), dtype=torch.uint8)
        return list(staged.unbind(0)), staged

    def scatter(self, pages: torch.Tensor, staged: torch.Tensor) -> None:
        """Unpack staged objects (one row each) into logical ``pages``."""
        pages = self.translator.host_physical(pages)
        off = 0
        for s in self.specs:
            nb = s.page_bytes(self.host.page_size)
            r = s.rows_per_page(self.host.page_size)
            part = staged[:, off : off + nb].contiguous().view(s.dtype)
            self.host.write_pages(
                s.name, pages, part.view(pages.numel(), s.num_layers, r, *s.row_shape)
            )
            off += nb
