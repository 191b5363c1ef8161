"""``kvtier serve``'s cache flags: one per ``CacheConfig`` field a single server process can
use, written for people (``--host-tier/--no-host-tier``, byte sizes as ``10G``, choices listed),
plus the sizing flags ``kvtier.server.sizing`` reads.

``--host`` is the address the server listens on; every ``--host-*`` flag is about the host
memory tier (L2, pinned CPU memory). Fields that are no flag are listed in ``NOT_FLAGS`` with
the reason. No module-level import of torch or of the cache (``kvtier --help`` stays fast): the
choices and defaults written here are checked against ``CacheConfig`` by the tests.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError
from kvtier.server.sizing import DEFAULT_MEM_FRACTION, SizeRequest, parse_bytes

if TYPE_CHECKING:
    from kvtier.config import CacheConfig


@dataclass(frozen=True)
class CacheFlag:
    """One ``CacheConfig`` field as a flag."""

    field: str
    """The ``CacheConfig`` field it sets."""
    kind: str
    """How its text converts: ``int``, ``float``, ``bytes``, ``bool`` (``--x/--no-x``),
    ``choice`` or ``text``."""
    help: str
    """What it does, for ``--help`` (the default is added from ``default``)."""
    default: Any
    """``CacheConfig``'s default, as ``--help`` states it (the tests compare the two)."""
    group: str
    """The ``--help`` section it is listed in."""
    choices: tuple[str, ...] = ()
    """The values a ``choice`` flag takes."""
    metavar: str | None = None
    """What its value is called in ``--help``."""
    flag: str = ""
    """The flag; ``--`` and the field's name with dashes when empty."""
    default_text: str = ""
    """How ``--help`` states the default when ``default`` alone would not say it."""

    @property
    def name(self) -> str:
        return self.flag or "--" + self.field.replace("_", "-")


DEVICE, HOST, STORAGE, BEHAVIOUR, EVENTS = (
    "device tier (L1)",
    "host tier (L2: pinned CPU memory; --host itself is the listen address)",
    "storage tier (L3)",
    "cache behaviour",
    "KV events (vLLM's format over ZeroMQ; needs kvtier[events])",
)
_WRITE = ("write_through", "write_through_selective", "write_back")
_PREFETCH = ("best_effort", "wait_complete", "timeout")
_COMPACT = ("auto", "eager", "off")

CACHE_FLAGS: tuple[CacheFlag, ...] = (
    CacheFlag("page_size", "int", "tokens per KV page", 16, DEVICE, metavar="N"),
    CacheFlag(
        "device",
        "text",
        "where the model and the device pool live: cuda, cuda:N or cpu",
        None,
        DEVICE,
        metavar="DEVICE",
        default_text="cuda when there is one, else cpu",
    ),
    CacheFlag(
        "enable_host",
        "bool",
        "keep a host memory tier (without it there is no storage tier either)",
        True,
        HOST,
        flag="--host-tier",
    ),
    CacheFlag(
        "host_mode",
        "choice",
        "cache: a cache level of its own; buffer_only: a staging buffer between device and "
        "storage (needs --storage)",
        "cache",
        HOST,
        choices=("cache", "buffer_only"),
    ),
    CacheFlag(
        "host_layout",
        "choice",
        "page_first: one block per page (one storage object is one copy); layer_first: as "
        "the device pool",
        "page_first",
        HOST,
        choices=("page_first", "layer_first"),
    ),
    CacheFlag(
        "pin_host",
        "bool",
        "pin the host tier's memory",
        None,
        HOST,
        default_text="pinned when CUDA is present",
    ),
    CacheFlag(
        "host_compaction",
        "choice",
        "sliding-window models: host pages take only the bytes they hold, holes closed by "
        "moving pages (auto, eager) or a fixed pool (off)",
        "off",
        HOST,
        choices=_COMPACT,
    ),
    CacheFlag(
        "kv_codec",
        "choice",
        "how host and storage tiers hold attention KV: none (exact), fp8_e4m3 or int8 (one "
        "byte per element plus a scale per page and head; lossy)",
        "none",
        HOST,
        choices=("none", "fp8_e4m3", "int8"),
    ),
    CacheFlag(
        "storage",
        "text",
        "storage backend: file or mooncake",
        None,
        STORAGE,
        metavar="BACKEND",
    ),
    CacheFlag(
        "storage_url",
        "text",
        "where mooncake lives: mooncake://MASTER:PORT?... or a JSON settings file",
        None,
        STORAGE,
        metavar="URL",
    ),
    CacheFlag(
        "storage_dir",
        "text",
        "directory of the file backend",
        "kvtier-data",
        STORAGE,
        metavar="DIR",
    ),
    CacheFlag(
        "storage_bytes",
        "bytes",
        "the file backend's budget; least recently used objects go past it",
        8 << 30,
        STORAGE,
        metavar="SIZE",
    ),
    CacheFlag(
        "prefetch_policy",
        "choice",
        "how long a request waits for its prefix to arrive from storage: never (best_effort), "
        "until it is all there (wait_complete) or up to --prefetch-timeout-s (timeout)",
        "timeout",
        STORAGE,
        choices=_PREFETCH,
    ),
    CacheFlag(
        "prefetch_timeout_s",
        "float",
        "the timeout prefetch policy's deadline, in seconds",
        5.0,
        STORAGE,
        metavar="SECONDS",
    ),
    CacheFlag(
        "prefetch_min_pages",
        "int",
        "storage hits shorter than this many pages are computed again instead",
        1,
        STORAGE,
        metavar="N",
    ),
    CacheFlag(
        "tenant_salt",
        "text",
        "mixed into every storage key, so that deployments with different salts never share "
        "objects",
        "",
        STORAGE,
        metavar="TEXT",
    ),
    CacheFlag(
        "storage_encryption",
        "bool",
        "seal every storage object with AES-256-GCM (key: --storage-key-file or "
        "$KVTIER_STORAGE_KEY, derived per --tenant-salt)",
        False,
        STORAGE,
    ),
    CacheFlag(
        "storage_key_file",
        "text",
        "file with the 32-byte storage encryption key (raw or 64 hex characters)",
        None,
        STORAGE,
        metavar="PATH",
    ),
    CacheFlag(
        "write_policy",
        "choice",
        "when device pages are copied to the host: at once (write_through), once a prefix "
        "was hit --write-threshold times (write_through_selective), on eviction (write_back)",
        "write_through",
        BEHAVIOUR,
        choices=_WRITE,
    ),
    CacheFlag(
        "write_threshold",
        "int",
        "hits before write_through_selective copies a page",
        2,
        BEHAVIOUR,
        metavar="N",
    ),
    CacheFlag(
        "eviction_policy",
        "choice",
        "which cached pages go first when a tier is full: least recently used (lru), least "
        "frequently used (lfu), or least recompute work saved per byte, aged (cost)",
        "lru",
        BEHAVIOUR,
        choices=("lru", "lfu", "cost"),
    ),
    CacheFlag(
        "backup_timing",
        "choice",
        "when a computed page is copied to the host: when its request finishes (at_insert) "
        "or layer by layer during the forward that computes it (per_layer)",
        "at_insert",
        BEHAVIOUR,
        choices=("at_insert", "per_layer"),
    ),
    CacheFlag(
        "cache_partial_pages",
        "bool",
        "cache the tokens of a finished request's last, partly filled page",
        True,
        BEHAVIOUR,
    ),
    CacheFlag(
        "backup_share",
        "float",
        "CUDA: share of the link's time between two steps that device-to-host backups may "
        "take (0: queue each backup whole)",
        0.8,
        BEHAVIOUR,
        metavar="X",
    ),
    CacheFlag(
        "transfer_mechanism",
        "choice",
        "CUDA: how device-host copies move (auto picks by block size)",
        "auto",
        BEHAVIOUR,
        choices=("auto", "kernel", "copy_engine"),
    ),
    CacheFlag(
        "compaction",
        "choice",
        "sliding-window models: when the device pool moves pages to close holes",
        "auto",
        BEHAVIOUR,
        choices=_COMPACT,
    ),
    CacheFlag(
        "restore_policy",
        "choice",
        "always: restore every cached page from the host tier or storage; cost: only where "
        "that is faster than computing it again at the measured rates",
        "always",
        BEHAVIOUR,
        choices=("always", "cost"),
    ),
    CacheFlag(
        "restore_rate_weight",
        "float",
        "share of each measured rate a new measurement replaces (0: keep the rates below)",
        0.1,
        BEHAVIOUR,
        metavar="X",
    ),
    CacheFlag(
        "restore_storage_rate",
        "float",
        "storage read rate in bytes/s until one is measured",
        2e9,
        BEHAVIOUR,
        metavar="BYTES_PER_S",
    ),
    CacheFlag(
        "restore_load_rate",
        "float",
        "host-to-device load rate in bytes/s until one is measured",
        1e10,
        BEHAVIOUR,
        metavar="BYTES_PER_S",
    ),
    CacheFlag(
        "restore_prefill_rate",
        "float",
        "prefill rate in tokens/s until a forward is measured",
        1000.0,
        BEHAVIOUR,
        metavar="TOKENS_PER_S",
    ),
    CacheFlag(
        "storage_admission",
        "choice",
        "all: write every host copy to storage; cost: only pages that take longer to compute "
        "again than to read back at the measured rates",
        "all",
        BEHAVIOUR,
        choices=("all", "cost"),
    ),
    CacheFlag(
        "kv_events",
        "text",
        "ZeroMQ endpoint to publish which pages each tier holds on (tcp://*:5557 binds, "
        "tcp://HOST:PORT connects, as in vLLM)",
        None,
        EVENTS,
        metavar="ENDPOINT",
        default_text="off",
    ),
    CacheFlag(
        "kv_events_replay",
        "text",
        "ZeroMQ endpoint bound for replay requests (8-byte start sequence number)",
        None,
        EVENTS,
        metavar="ENDPOINT",
        default_text="none",
    ),
    CacheFlag(
        "kv_events_instance",
        "text",
        "this instance's id, sent as the ZeroMQ topic of every batch",
        "",
        EVENTS,
        metavar="ID",
        default_text="HOSTNAME:PID",
    ),
    CacheFlag(
        "kv_events_queue",
        "int",
        "batches waiting for the publisher thread before a step's batch is dropped",
        1000,
        EVENTS,
        metavar="N",
    ),
    CacheFlag(
        "kv_events_buffer",
        "int",
        "batches kept for replay",
        10_000,
        EVENTS,
        metavar="N",
    ),
    CacheFlag(
        "debug_checks",
        "bool",
        "check the cache's invariants at every step (slow)",
        False,
        BEHAVIOUR,
    ),
)

SIZING_FIELDS = frozenset({"device_pages", "host_pages", "host_bytes", "host_ratio"})
"""``CacheConfig`` fields the sizing flags set (``kvtier.server.sizing``)."""

NOT_FLAGS: dict[str, str] = {
    "model_fingerprint": "set from the model's weights and architecture",
    "unbound_namespace": "the server always binds storage keys to its model",
    "rank": "one server process is one shard",
    "world_size": "one server process is one shard",
    "cp_size": "context parallelism runs one process per rank; the server is one process",
    "cp_rank": "context parallelism runs one process per rank; the server is one process",
    "cp_pattern": "context parallelism runs one process per rank; the server is one process",
    "test_completion_polls": "for tests only",
    "test_completion_seed": "for tests only",
    "extra_namespace": "--tenant-salt separates deployments' storage keys",
}
"""``CacheConfig`` fields ``kvtier serve`` has no flag for, and why."""


def _bytes_type(flag: str) -> Any:
    def convert(text: str) -> int:
        try:
            return parse_bytes(text, flag)
        except ConfigError as e:
            # argparse then says "argument FLAG: <message>" and exits 2
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{flag} ")) from None

    convert.__name__ = "byte size"
    return convert


def _number_type(kind: str) -> Any:
    def convert(text: str) -> int | float:
        try:
            return int(text) if kind == "int" else float(text)
        except ValueError:
            what = "an integer" if kind == "int" else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None

    return convert


def _default_text(flag: CacheFlag) -> str:
    if flag.default_text:
        return flag.default_text
    if flag.kind == "bytes":
        from kvtier.server.sizing import format_bytes

        return format_bytes(flag.default)
    if flag.kind == "bool":
        return {True: "on", False: "off", None: "auto"}[flag.default]
    if flag.default is None or flag.default == "":
        return "none"
    return str(flag.default)


def add_cache_flags(parser: argparse.ArgumentParser) -> None:
    """The sizing flags and one flag per ``CACHE_FLAGS`` entry; a flag not given leaves
    ``CacheConfig``'s default."""
    size = parser.add_argument_group(
        "pool sizes (the device pool is sized from free memory unless --device-pages or "
        "--device-bytes is given; sizes take K/M/G/T, KiB/MiB/GiB or KB/MB/GB suffixes)"
    )
    size.add_argument(
        "--mem-fraction",
        type=_number_type("float"),
        default=DEFAULT_MEM_FRACTION,
        metavar="F",
        help="CUDA: share of the device memory free after the weights and a workspace for "
        f"the forward pass that the device pool takes (default: {DEFAULT_MEM_FRACTION})",
    )
    size.add_argument(
        "--device-pages",
        type=_number_type("int"),
        metavar="N",
        help="device pool size in pages (overrides --mem-fraction)",
    )
    size.add_argument(
        "--device-bytes",
        type=_bytes_type("--device-bytes"),
        metavar="SIZE",
        help="device pool size in bytes (overrides --mem-fraction)",
    )
    size.add_argument(
        "--host-pages", type=_number_type("int"), metavar="N", help="host tier size in pages"
    )
    size.add_argument(
        "--host-bytes",
        type=_bytes_type("--host-bytes"),
        metavar="SIZE",
        help="host tier size in bytes",
    )
    size.add_argument(
        "--host-ratio",
        type=_number_type("float"),
        metavar="X",
        help="host tier size as a multiple of the device pool (default: 2, at most half of "
        "the host memory available at start)",
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in CACHE_FLAGS:
        if f.group not in groups:
            groups[f.group] = parser.add_argument_group(f.group)
        group = groups[f.group]
        kw: dict[str, Any] = {
            "dest": f"cache_{f.field}",
            "default": argparse.SUPPRESS,
            "help": f"{f.help} (default: {_default_text(f)})",
        }
        if f.kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        elif f.kind == "choice":
            kw["choices"] = f.choices
        elif f.kind == "bytes":
            kw.update(type=_bytes_type(f.name), metavar=f.metavar)
        elif f.kind in ("int", "float"):
            kw.update(type=_number_type(f.kind), metavar=f.metavar)
        else:
            kw["metavar"] = f.metavar
        group.add_argument(f.name, **kw)


def cache_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The ``CacheConfig`` fields the cache flags gave (sizing flags aside)."""
    return {k.removeprefix("cache_"): v for k, v in vars(args).items() if k.startswith("cache_")}


def size_request_from_args(args: argparse.Namespace) -> SizeRequest:
    """The sizing flags; ``ConfigError`` naming a flag whose value cannot be."""
    for flag in ("device_pages", "host_pages"):
        v = getattr(args, flag, None)
        if v is not None and v < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be at least 1, got {v}")
    ratio = getattr(args, "host_ratio", None)
    if ratio is not None and not ratio > 0:
        raise ConfigError(f"--host-ratio must be a positive number, got {ratio}")
    return SizeRequest(
        device_pages=getattr(args, "device_pages", None),
        device_bytes=getattr(args, "device_bytes", None),
        mem_fraction=getattr(args, "mem_fraction", DEFAULT_MEM_FRACTION),
        host_pages=getattr(args, "host_pages", None),
        host_bytes=getattr(args, "host_bytes", None),
        host_ratio=ratio,
    )


def cache_config_from_args(args: argparse.Namespace) -> CacheConfig:
    """The ``CacheConfig`` of the cache flags and the sizes given as flags (the device pool
    at ``CacheConfig``'s default when no flag sizes it: ``kvtier serve`` sizes it from free
    memory instead). Raises ``ConfigError`` naming a bad option."""
    from kvtier.config import CacheConfig

    req = size_request_from_args(args)
    kw = cache_kwargs_from_args(args)
    for name in ("device_pages", "host_pages", "host_bytes", "host_ratio"):
        if getattr(req, name) is not None:
            kw[name] = getattr(req, name)
    return CacheConfig(**kw)
