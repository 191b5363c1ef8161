"""Configuration of the multi-head latent attention family (``kvtier.engine.families.mla``):
``MLAConfig``, its variants (dense ``mla``, sparse ``dsa`` and ``dsa-compressed``), DeepSeek-V3's
mixture-of-experts fields, and the family's presets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from kvtier.engine.common import DTYPES
from kvtier.engine.model_config import ROPE_DEFAULTS, RopeConfig

VARIANTS = ("mla", "dsa", "dsa-compressed")
MOE_FIELDS = (
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "n_shared_experts",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "norm_topk_prob",
    "first_k_dense_replace",
)


@dataclass(frozen=True)
class MLAConfig(RopeConfig):
    """A decoder with multi-head latent attention, optionally sparse through an indexer."""

    family: ClassVar[str] = "mla"
    # options added after MLA digests were in use: at their defaults they leave them as they were
    fingerprint_omit_default: ClassVar[frozenset[str]] = frozenset(
        {
            "q_lora_rank",
            "rope_interleave",
            "softmax_scale_factor",
            "weights_digest",
            *ROPE_DEFAULTS,
            *MOE_FIELDS,
        }
    )

    num_layers: int = 3
    """Decoder layers (each holds one layer in every pool)."""

    kv_lora_rank: int = 32
    """Width of the normalised KV latent ``c_kv`` stored per token."""
    qk_nope_head_dim: int = 16
    """Per-head query/key width without RoPE (keys decompressed from ``c_kv``)."""
    qk_rope_head_dim: int = 8
    """Per-head query width with RoPE; the RoPE key part is shared by all heads and stored."""
    v_head_dim: int = 16
    """Per-head value width (decompressed from ``c_kv``)."""
    q_lora_rank: int = 0
    """Width of the normalised query latent (DeepSeek-V3's ``q_a_proj``, ``q_a_layernorm``,
    ``q_b_proj``); ``0``: queries are projected directly (``q_proj``)."""
    weights_digest: str = ""
    """Digest of a checkpoint's weight files (``load_model``); empty for random weights."""
    softmax_scale_factor: float = 1.0
    """Multiplies the attention's softmax scale ``1 / sqrt(qk_nope_head_dim +
    qk_rope_head_dim)``: DeepSeek's YaRN ``mscale(rope_factor, mscale_all_dim) ** 2``,
    resolved when a config is read."""
    n_routed_experts: int = 0
    """Routed experts of a DeepSeek-V3 mixture-of-experts MLP (``kvtier.engine.families.moe``)
    in the layers from ``first_k_dense_replace`` on; ``0``: every layer's MLP is dense."""
    num_experts_per_tok: int = 8
    """Experts each token is routed to."""
    moe_intermediate_size: int = 64
    """Width of each routed expert's SwiGLU (and of each shared one)."""
    n_shared_experts: int = 0
    """Experts every token also goes through (fused into one SwiGLU)."""
    n_group: int = 1
    """Expert groups; routing picks experts only from the ``topk_group`` best groups."""
    topk_group: int = 1
    """Groups routing picks from."""
    routed_scaling_factor: float = 1.0
    """Multiplies the routed experts' weights."""
    norm_topk_prob: bool = True
    """Normalise each token's chosen weights to sum one (before the scaling factor)."""
    first_k_dense_replace: int = 0
    """Leading layers whose MLP stays dense."""
    rope_interleave: bool = False
    """The RoPE dims of queries and the shared key hold interleaved pairs (DeepSeek-V3's
    default): they are reordered to the half-split layout before the rotation, as transformers
    does. Only the math differs; the stored rows keep their width."""
    variant: str = "mla"
    """``mla`` (dense latent attention), ``dsa`` (per-token indexer keys, top-k tokens) or
    ``dsa-compressed`` (one indexer row per token group, top-k groups)."""
    index_n_heads: int = 2
    """Indexer query heads (``dsa`` variants)."""
    index_head_dim: int = 16
    """Width of an indexer key, query head and compressed row (``dsa`` variants)."""
    index_topk: int = 32
    """Tokens each query attends to, its own included (``dsa``)."""
    index_page_size: int = 16
    """With ``index_kpool``, sets the group size ``G = index_page_size * index_kpool``
    (``dsa-compressed``)."""
    index_kpool: int = 2
    """Index pages pooled into one compressed row (``dsa-compressed``)."""
    index_topk_groups: int = 4
    """Earlier complete groups each query attends to besides its own (``dsa-compressed``)."""

    def __post_init__(self) -> None:
        self._check_sizes(
            "seed", "q_lora_rank", "n_routed_experts", "n_shared_experts", "first_k_dense_replace"
        )
        for opt in ("q_lora_rank", "n_routed_experts", "n_shared_experts", "first_k_dense_replace"):
            v = getattr(self, opt)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise self._error(f"{opt} must be an integer >= 0, got {v!r}")
        self._check_rope()
        self._check_moe()
        if not self.softmax_scale_factor > 0:
            raise self._error(f"softmax_scale_factor={self.softmax_scale_factor} must be positive")
        if not isinstance(self.rope_interleave, bool):
            raise self._error(
                f"rope_interleave must be True or False, got {self.rope_interleave!r}"
            )
        self._check_even("qk_rope_head_dim", "index_head_dim")
        self._check_choice("dtype", DTYPES)
        self._check_choice("variant", VARIANTS)
        for opt in ("rope_theta", "rms_norm_eps"):
            if not getattr(self, opt) > 0:
                raise self._error(f"{opt} must be positive, got {getattr(self, opt)!r}")
        self._check_eos()

    def _check_moe(self) -> None:
        e = self.n_routed_experts
        if not e:
            return
        if not 1 <= self.num_experts_per_tok <= e:
            raise self._error(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, "
                f"n_routed_experts={e}]"
            )
        if e % self.n_group or e // self.n_group < 2:
            raise self._error(
                f"n_routed_experts={e} must split into n_group={self.n_group} groups of at "
                "least 2 (a group scores by its two best experts)"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise self._error(
                f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]"
            )
        if not self.routed_scaling_factor > 0:
            raise self._error(
                f"routed_scaling_factor={self.routed_scaling_factor} must be positive"
            )
        if not isinstance(self.norm_topk_prob, bool):
            raise self._error(f"norm_topk_prob must be True or False, got {self.norm_topk_prob!r}")

    def moe_layer(self, i: int) -> bool:
        """Whether layer ``i``'s MLP is the mixture of experts."""
        return self.n_routed_experts > 0 and i >= self.first_k_dense_replace

    @property
    def latent_dim(self) -> int:
        """Width of one anchor row: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def index_group(self) -> int:
        """Tokens per compressed index row (``dsa-compressed``)."""
        return self.index_page_size * self.index_kpool


def mla_preset(**overrides: Any) -> MLAConfig:
    """Dense multi-head latent attention."""
    return MLAConfig(**{"variant": "mla", **overrides})


def dsa_preset(**overrides: Any) -> MLAConfig:
    """MLA with per-token indexer keys; top-24 tokens, so prompts of a few hundred are sparse."""
    return MLAConfig(**{"variant": "dsa", "index_topk": 24, **overrides})


def dsa_compressed_preset(**overrides: Any) -> MLAConfig:
    """MLA with one indexer row per 32-token group; each query sees 3 earlier groups + its own."""
    base = {"variant": "dsa-compressed", "index_page_size": 16, "index_kpool": 2}
    return MLAConfig(**{**base, "index_topk_groups": 3, **overrides})
