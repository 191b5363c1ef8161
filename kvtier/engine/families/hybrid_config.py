"""Configuration of the hybrid recurrent family (``kvtier.engine.families.hybrid``):
``HybridConfig``, which layers are attention and which recurrent, the recurrent state's size,
and the family's preset."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from kvtier.engine.common import ConfigBase
from kvtier.engine.model_config import dense_config_of


@dataclass(frozen=True)
class HybridConfig(ConfigBase):
    """Recurrent (Mamba-1) layers interleaved with GQA attention layers."""

    family: ClassVar[str] = "hybrid"
    fingerprint_exclude: ClassVar[frozenset[str]] = frozenset({"eos_token_ids", "checkpoint_every"})

    attn_every: int = 2
    """Every ``attn_every``-th layer is attention (layers ``attn_every - 1``,
    ``2 * attn_every - 1``, ...), the rest recurrent; ``2`` gives ``RARA...``. Between 2 and
    ``num_layers`` so that both kinds exist."""
    num_kv_heads: int = 2
    """Key/value heads; ``num_heads`` must be a multiple of it (GQA)."""
    head_dim: int = 32
    """Per-head width of q, k and v (even, for RoPE)."""
    expand: int = 2
    """Recurrent mixer width ``d_inner = expand * hidden_size``."""
    d_conv: int = 4
    """Kernel of the causal depthwise conv; its state holds the last ``d_conv - 1`` inputs
    (none for ``1``)."""
    d_state: int = 8
    """SSM state size per channel."""
    dt_rank: int = 8
    """Width of the time-step projection (Mamba's ``time_step_rank``): ``x_proj`` yields it,
    ``dt_proj`` widens it to ``d_inner``."""
    checkpoint_every: int = 2
    """The engine writes a state checkpoint at the end of every ``checkpoint_every``-th cache
    page (pages ``checkpoint_every - 1``, ``2 * checkpoint_every - 1``, ...); a cached prefix is
    resumable only up to its last checkpoint. Does not change the model's math."""

    def __post_init__(self) -> None:
        self._check_sizes("seed", "attn_every")
        a = self.attn_every
        if isinstance(a, bool) or not isinstance(a, int) or not 2 <= a <= self.num_layers:
            raise self._error(
                f"attn_every={a!r} must be an integer in [2, num_layers="
                f"{self.num_layers}] so the model has both recurrent and attention layers"
            )
        dense_config_of(self)  # validates the fields shared with the dense decoder

    @property
    def d_inner(self) -> int:
        return self.expand * self.hidden_size

    @property
    def attn_layers(self) -> tuple[int, ...]:
        """Indices of the attention layers; the others are recurrent."""
        return tuple(i for i in range(self.num_layers) if (i + 1) % self.attn_every == 0)

    @property
    def state_numel(self) -> int:
        """Elements of one recurrent layer's state (one state-pool row)."""
        return self.d_inner * (self.d_conv - 1 + self.d_state)


def hybrid_preset(**overrides: Any) -> HybridConfig:
    """The default hybrid config (fast on CPU) with ``overrides`` applied."""
    return HybridConfig(**overrides)
