"""The router learns an instance's page size and device pool from a real ``kvtier serve``
model card (``page_size``, the cache's tree page; ``device_tokens``), with no ``--page-size``
and no KV events."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import httpx2 as httpx
from server_harness import cache_config, start

from kvtier.route.fleet import Fleet, FleetOptions
from kvtier.route.instances import InstanceSpec


def test_the_fleet_reads_the_page_size_from_the_model_card() -> None:
    server = start(cache=cache_config(page_size=8))
    try:

        async def join() -> tuple[bool, int | None, int, int | None]:
            async with httpx.AsyncClient() as client:
                fleet = Fleet([InstanceSpec(server.url)], FleetOptions(page_size=16), client)
                await fleet.check_health()
                inst = fleet.instances[0]
                return inst.healthy, inst.page_size, inst.page_size_or(16), inst.device_tokens

        # the harness's pool: 128 pages of 8 tokens
        assert asyncio.run(join()) == (True, 8, 8, 1024)
    finally:
        server.stop()
