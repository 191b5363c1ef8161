"""``kvtier route``: its flags and the run. Imports only ``argparse`` at the top so that
``kvtier --help`` stays fast; FastAPI, uvicorn, httpx and ZMQ are imported when it runs.

``docs/routing.md`` is the user's guide."""

from __future__ import annotations

import argparse
import sys

from kvtier.bench.commands import non_negative_float, positive_float, positive_int

LOG_LEVELS = ("debug", "info", "warning", "error")


def add_route_command(sub: argparse._SubParsersAction) -> None:
    """Add ``route`` to the ``kvtier`` command list."""
    r = sub.add_parser(
        "route",
        help="OpenAI-compatible router over several kvtier serve instances",
        description="An OpenAI-compatible front over several `kvtier serve` instances: each "
        "request goes to the instance with the least expected prefill time, from the pages "
        "of its prompt each instance holds on device, host and storage (their KV events) and "
        "the requests each has in flight; least-loaded when events are missing or stale. "
        "Needs the route extra.",
    )
    r.add_argument(
        "--instance",
        action="append",
        metavar="URL[,events=ENDPOINT][,replay=ENDPOINT]",
        help="a kvtier serve instance (repeat per instance): its base URL, and optionally its "
        "KV event PUB endpoint and replay ROUTER endpoint, e.g. "
        "http://10.0.0.2:8000,events=tcp://10.0.0.2:5557,replay=tcp://10.0.0.2:5558",
    )
    r.add_argument("--host", default="127.0.0.1", help="address to listen on")
    r.add_argument("--port", type=int, default=8080, help="port to listen on (0: any free)")
    r.add_argument(
        "--page-size",
        type=positive_int,
        default=16,
        help="tokens per page when neither an instance's KV events nor its model card say",
    )
    r.add_argument(
        "--prefill-rate",
        type=positive_float,
        default=8000.0,
        help="prompt tokens per second an instance computes (prices uncached tokens)",
    )
    r.add_argument(
        "--host-rate",
        type=positive_float,
        default=200000.0,
        help="tokens per second an instance loads from its host tier",
    )
    r.add_argument(
        "--storage-rate",
        type=positive_float,
        default=40000.0,
        help="tokens per second an instance reads from its storage tier",
    )
    r.add_argument(
        "--request-cost-s",
        type=non_negative_float,
        default=0.05,
        help="seconds each request in flight on an instance adds to a new one's wait",
    )
    r.add_argument(
        "--request-duration-s",
        type=non_negative_float,
        default=0.05,
        help="seconds a request holds its device pages: the wait per request that must end "
        "before a new one fits",
    )
    r.add_argument(
        "--health-interval-s",
        type=positive_float,
        default=0.5,
        help="seconds between two /health checks of an instance",
    )
    r.add_argument(
        "--events-stale-s",
        type=positive_float,
        default=10.0,
        help="an instance whose KV events (or heartbeats) stopped this long is routed by load",
    )
    r.add_argument(
        "--shared-storage",
        action="store_true",
        help="the instances share one L3 (one Mooncake master and tenant salt): a page any of "
        "them stored counts as a storage hit on every instance",
    )
    r.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="log verbosity")
    r.set_defaults(func=route)


def route(args: argparse.Namespace) -> int:
    """Run the router until SIGINT/SIGTERM; exit code 2 for a bad option or a missing extra
    (one line on stderr naming it)."""
    from kvtier.route.instances import RouteConfigError, parse_instances

    try:
        specs = parse_instances(args.instance)
        if not 0 <= args.port < 65536:
            raise RouteConfigError(f"--port must be in [0, 65535], got {args.port}")
    except RouteConfigError as e:
        print(f"kvtier route: {e}", file=sys.stderr)
        return 2
    try:
        import httpx2 as httpx
        import uvicorn

        from kvtier.route.fleet import FleetOptions
        from kvtier.route.proxy import create_app
        from kvtier.route.scorer import Rates

        if any(s.events for s in specs):
            import msgpack  # noqa: F401
            import zmq  # noqa: F401
    except ImportError as e:
        print(f"kvtier route: {e.name} is missing: pip install 'kvtier[route]'", file=sys.stderr)
        return 2
    import asyncio
    import logging

    from kvtier.route.fleet import Fleet
    from kvtier.server.frozen_startup import freeze_startup_objects

    logging.getLogger("kvtier").setLevel(args.log_level.upper())

    options = FleetOptions(
        rates=Rates(
            args.prefill_rate,
            args.host_rate,
            args.storage_rate,
            args.request_cost_s,
            args.request_duration_s,
        ),
        page_size=args.page_size,
        health_interval_s=args.health_interval_s,
        events_stale_s=args.events_stale_s,
        shared_storage=args.shared_storage,
    )

    async def main() -> None:
        # generations run for minutes: no read timeout, only a connect one (a dead instance)
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0)) as client:
            app = create_app(Fleet(specs, options, client), client)
            config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
            freeze_startup_objects()
            await uvicorn.Server(config).serve()

    asyncio.run(main())
    return 0
