"""What computing cached tokens again costs: the savings a cached page stands for.

A token's forward does a fixed amount of work in its linear layers (projections, MLP) and an
amount that grows with the context it attends over. Computing ``n`` tokens that follow a prefix
of ``d`` tokens therefore costs, in units of one token's linear work::

    n x (1 + (d + n / 2) / context)

``context`` being the context length at which a token's attention costs as much as its linear
layers (``b / a`` for a per-token cost ``a`` and a per-token-per-context-token cost ``b``). The
unit is a token: at the prefill rate (tokens per second) it becomes seconds. Only the ratio
matters for ordering pages against each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.errors import ConfigError

if TYPE_CHECKING:
    from kvtier.pools.spec import PoolSpec

LINEAR_PER_ATTENTION = 6
"""A dense layer of hidden size ``h`` does about ``24 h^2`` FLOPs per token in its weights and
``4 h`` per context token in attention (scores and the weighted sum): equal at ``6 h`` tokens."""


@dataclass(frozen=True, slots=True)
class RecomputeWork:
    """The work of computing tokens again, in tokens (see the module)."""

    context: float
    """Context tokens at which a token's attention costs as much as its linear layers."""

    def __post_init__(self) -> None:
        if not self.context > 0:
            raise ConfigError(f"recompute work: context must be positive, got {self.context}")

    def tokens(self, depth: int, n: int) -> float:
        """The work of ``n`` tokens computed after a prefix of ``depth`` tokens."""
        return n * (1.0 + (depth + n / 2) / self.context)

    @classmethod
    def from_specs(cls, specs: Sequence[PoolSpec]) -> RecomputeWork:
        """An estimate from a pool set: the hidden size is taken as the elements of one token's
        anchor row (K and V of every KV head; MLA's latent row), so ``context`` is
        ``LINEAR_PER_ATTENTION`` times that. Grouped-query heads make the real hidden size
        larger (attention counts for less); the estimate only shifts how fast a page's cost
        grows with its depth."""
        if not specs:
            raise ConfigError("recompute work of an empty pool set")
        return cls(float(LINEAR_PER_ATTENTION * specs[0].row_numel))
