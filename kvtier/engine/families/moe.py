"""DeepSeek-V3's mixture of experts, the MLP of an MLA model's later layers: a sigmoid router
with a score correction bias and group-limited top-k, routed SwiGLU experts and shared ones."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.engine.model import MLP

if TYPE_CHECKING:
    from kvtier.engine.families.mla_config import MLAConfig


class Router(nn.Module):
    """Picks ``num_experts_per_tok`` experts per token and their weights, as transformers'
    DeepSeek-V3 router does: sigmoid scores (float32); the correction bias shifts only the
    choice; experts come from the ``topk_group`` groups whose two best biased scores sum
    highest; the weights are the unbiased scores, normalised to sum one when
    ``norm_topk_prob``, times ``routed_scaling_factor``."""

    def __init__(self, c: MLAConfig) -> None:
        super().__init__()
        dt, e = c.torch_dtype, c.n_routed_experts
        self.cfg = c
        self.weight = nn.Parameter(torch.zeros(e, c.hidden_size, dtype=dt), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(e, dtype=dt), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k] float32, experts [T, k])`` for the tokens ``x`` ``[T, hidden]``."""
        c = self.cfg
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        per_group = c.n_routed_experts // c.n_group
        groups = choice.view(-1, c.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        best = groups.topk(c.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(groups).scatter_(1, best, 1.0).bool()
        keep = keep[:, :, None].expand(-1, -1, per_group).reshape(-1, c.n_routed_experts)
        picked = choice.masked_fill(~keep, float("-inf"))
        experts = picked.topk(c.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * c.routed_scaling_factor, experts


class MoE(nn.Module):
    """Routed experts (``experts.{i}``, each a SwiGLU ``moe_intermediate_size`` wide) weighted
    by the router, plus ``n_shared_experts`` always-on experts fused into one SwiGLU
    (``shared_experts``). Parameter names are a DeepSeek-V3 checkpoint's."""

    def __init__(self, c: MLAConfig) -> None:
        super().__init__()
        self.gate = Router(c)
        self.experts = nn.ModuleList(
            MLP(c, c.moe_intermediate_size) for _ in range(c.n_routed_experts)
        )
        width = c.moe_intermediate_size * c.n_shared_experts
        self.shared_experts = MLP(c, width) if width else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.gate(flat)
        out = torch.zeros_like(flat)
        # one pass per expert some token picked (a host sync: this engine is the reference)
        for e in torch.unique(experts).tolist():
            tokens, slot = torch.nonzero(experts == e, as_tuple=True)
            y = self.experts[e](flat[tokens]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(x.shape)
