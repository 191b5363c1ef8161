"""The hybrid family's recurrent mixer against transformers' ``MambaMixer`` (Mamba-1): with the
same weights, copied by name, it gives transformers' output over a whole sequence, and the same
output when the sequence runs in pieces, each resuming from the state the last one left (the
state the cache's ``state`` pool checkpoints). Nothing here compares kvtier with itself."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine.families.hybrid import RecurrentMixer
from kvtier.engine.families.hybrid_config import HybridConfig

transformers = pytest.importorskip("transformers")

HIDDEN, D_STATE, D_CONV, EXPAND, DT_RANK = 64, 8, 4, 2, 8
TOKENS = 37


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, RecurrentMixer]:
    from transformers.models.mamba.modeling_mamba import MambaMixer

    hf_cfg = transformers.MambaConfig(
        hidden_size=HIDDEN,
        state_size=D_STATE,
        conv_kernel=D_CONV,
        expand=EXPAND,
        time_step_rank=DT_RANK,
        use_conv_bias=True,
        use_bias=False,
        num_hidden_layers=1,
        vocab_size=64,
    )
    hf = MambaMixer(hf_cfg, layer_idx=0).float().eval()
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        # every parameter a distinct, order-one value (transformers' init leaves D at one) ...
        for p in hf.parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 1 else fan_in**-0.5))
        # ... then a decay that remembers tens of tokens and a time step near 0.05
        hf.A_log.copy_(torch.log(torch.arange(1, D_STATE + 1.0)).expand(HIDDEN * EXPAND, -1))
        hf.dt_proj.bias.fill_(-3.0)
    config = HybridConfig(
        hidden_size=HIDDEN, d_state=D_STATE, d_conv=D_CONV, expand=EXPAND, dt_rank=DT_RANK
    )
    mixer = RecurrentMixer(config).eval()
    # strict: every parameter of each side has its counterpart of the same name and shape
    mixer.load_state_dict(hf.state_dict(), strict=True)
    return hf, mixer


def _hidden() -> torch.Tensor:
    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(5))


@torch.no_grad()
def test_whole_sequence_equals_transformers(pair) -> None:
    hf, mixer = pair
    x = _hidden()
    want = hf(x[None])[0]
    state = torch.zeros(mixer.d_inner * (D_CONV - 1 + D_STATE))
    torch.testing.assert_close(mixer(x, state), want, atol=1e-5, rtol=1e-4)
    # the output depends on the past through the state: a shuffled prefix changes the tail
    shuffled = torch.cat((x[:-5].flip(0), x[-5:]))
    assert not torch.allclose(hf(shuffled[None])[0][-5:], want[-5:], atol=1e-3)


@pytest.mark.parametrize("cuts", [(1,), (16,), (3, 4, 20), tuple(range(1, TOKENS))])
@torch.no_grad()
def test_pieces_resuming_from_the_state_equal_transformers(pair, cuts: tuple[int, ...]) -> None:
    hf, mixer = pair
    x = _hidden()
    want = hf(x[None])[0]
    state = torch.zeros(mixer.d_inner * (D_CONV - 1 + D_STATE))
    rows = torch.zeros(len(cuts), state.numel())
    bounds = (0, *cuts, TOKENS)
    outs = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        # each piece also checkpoints the state after its last token into a state row ...
        outs.append(mixer(x[a:b], state, [(b - a - 1, i)] if i < len(cuts) else [], rows))
    torch.testing.assert_close(torch.cat(outs), want, atol=1e-5, rtol=1e-4)
    # ... and a fresh run resumed from any checkpoint row gives transformers' tail
    for i, cut in enumerate(cuts):
        resumed = mixer(x[cut:], rows[i].clone())
        torch.testing.assert_close(resumed, want[cut:], atol=1e-5, rtol=1e-4)
