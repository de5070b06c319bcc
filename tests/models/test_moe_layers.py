"""The mixture-of-experts block against a token-by-token reference: routing (softmax, top-k,
renormalisation), experts computed batched by expert (one call per active expert), and which
layers of each family are sparse."""

from __future__ import annotations

import pytest
import torch
from support.tiny_models import tiny_config

from cadence.distributed.group import SINGLE_RANK
from cadence.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from cadence.models.moe_layers import MoeSpec, StackedExperts, route


def test_route_picks_the_top_k_by_probability_and_renormalises() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.15, 0.35, 0.45, 0.05]]))
    weights, experts = route(logits, 2, renormalize=False)
    assert experts.tolist() == [[1, 3], [2, 1]]
    torch.testing.assert_close(weights, torch.tensor([[0.4, 0.3], [0.45, 0.35]]))
    weights, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights, torch.tensor([[4 / 7, 3 / 7], [0.45 / 0.8, 0.35 / 0.8]]))


def _experts(num_experts: int = 6) -> StackedExperts:
    torch.manual_seed(0)
    experts = StackedExperts(num_experts, 16, 24, "silu", SINGLE_RANK, torch.float32, "cpu", fused=False)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    return experts


def _one_token_at_a_time(experts: StackedExperts, x: torch.Tensor, weights: torch.Tensor,
                         chosen: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], chosen[t], strict=True):
            gate, up = (x[t] @ experts.gate_up_proj[e].T).split(experts.intermediate_size)
            out[t] += w * ((torch.nn.functional.silu(gate) * up) @ experts.down_proj[e].T)
    return out


def test_experts_run_batched_by_expert_and_equal_a_token_by_token_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    experts = _experts()
    x = torch.randn(9, 16)
    weights, chosen = route(torch.randn(9, 6), 2, renormalize=True)
    calls: list[int] = []
    original = StackedExperts._expert

    def counted(self: StackedExperts, expert: int, rows: torch.Tensor) -> torch.Tensor:
        calls.append(rows.shape[0])
        return original(self, expert, rows)

    monkeypatch.setattr(StackedExperts, "_expert", counted)
    out = experts(x, weights, chosen)
    torch.testing.assert_close(out, _one_token_at_a_time(experts, x, weights, chosen), atol=1e-5, rtol=1e-5)
    # One call per expert that any token chose, over all of its rows: never one per token.
    assert len(calls) == len(set(chosen.flatten().tolist())) and sum(calls) == 9 * 2


def test_an_expert_no_token_chose_is_never_run(monkeypatch: pytest.MonkeyPatch) -> None:
    experts = _experts()
    chosen = torch.tensor([[3, 1], [1, 3], [3, 1]])
    ran: list[int] = []
    original = StackedExperts._expert
    monkeypatch.setattr(StackedExperts, "_expert",
                        lambda self, expert, rows: ran.append(expert) or original(self, expert, rows))
    experts(torch.randn(3, 16), torch.full((3, 2), 0.5), chosen)
    assert ran == [1, 3]


def test_each_family_says_which_layers_are_sparse() -> None:
    qwen = tiny_config("qwen2_moe", num_hidden_layers=6, num_experts=4, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [Qwen2MoeForCausalLM.is_sparse(qwen, i) for i in range(6)] == [False, True, False, False, False, True]
    qwen3 = tiny_config("qwen3_moe", num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0])
    assert [Qwen3MoeForCausalLM.is_sparse(qwen3, i) for i in range(3)] == [False, True, True]
    mixtral = tiny_config("mixtral", num_local_experts=4, num_experts_per_tok=2)
    assert MixtralForCausalLM.is_sparse(mixtral, 0)
    assert MixtralForCausalLM.moe_spec(mixtral) == MoeSpec(4, 2, 128, renormalize=True, fp32_weights=True)


def test_more_experts_per_token_than_experts_is_refused() -> None:
    with pytest.raises(ValueError, match="routed to 8 experts of 4"):
        Qwen3MoeForCausalLM.moe_spec(tiny_config("qwen3_moe", num_experts=4, num_experts_per_tok=8))
