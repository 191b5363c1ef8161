"""Names of tiers and copy directions, shared by pools, tree, controller, transfer and metrics.

They are ``Literal`` strings rather than enums so that ``stats()`` keys (``device_hit_tokens``),
metric labels (``hit_pages{tier="host"}``) and existing call sites keep their plain-string
values; a type checker catches a misspelt literal, and ``check_tier``/``check_direction`` catch
one that arrives at run time (a branch such as ``device if tier == "device" else host`` would
otherwise read a typo as ``host``).
"""

from __future__ import annotations

from typing import Literal, cast, get_args

from kvtier.errors import IntegrityError

Tier = Literal["device", "host", "storage"]
"""Where a page lives: L1 device pool, L2 host pool, L3 storage backend."""

Direction = Literal["d2h", "h2d"]
"""A copy between the device and host pools: ``d2h`` backs up, ``h2d`` loads."""

TIERS: tuple[Tier, ...] = get_args(Tier)
"""Every tier, fastest first."""

DIRECTIONS: tuple[Direction, ...] = get_args(Direction)
"""Every copy direction."""


def check_tier(value: object, where: str = "tier") -> Tier:
    """``value`` as a ``Tier``; raises ``IntegrityError`` naming ``where`` and the value for
    anything else (kvtier computes tiers itself, so a bad one is a bug, not a user mistake)."""
    if value not in TIERS:
        raise IntegrityError(f"{where}={value!r} is not one of {', '.join(TIERS)}")
    return cast(Tier, value)


def check_direction(value: object, where: str = "direction") -> Direction:
    """``value`` as a ``Direction``; raises ``IntegrityError`` naming ``where`` and the value
    for anything else."""
    if value not in DIRECTIONS:
        raise IntegrityError(f"{where}={value!r} is not one of {', '.join(DIRECTIONS)}")
    return cast(Direction, value)
