"""Aria's experts as transformers releases before the experts decorator hold them (5.17): grouped-GEMM
`fc1` / `fc2` weights [E, in, out] driven by `forward(input, tokens_per_expert)`, and an experts
module that routes its own tokens from the router logits. The module is rebuilt here with that
layout and that math so the adapter runs on every release; on 5.17 the family sweep wraps the real
class as well.

Legend: T = tokens, H = hidden, E = experts, I = expert intermediate size, k = experts per token.
"""
import pytest
import torch
import transformers
from torch import nn

from dwdp.models.adapters import Unsupported, find_experts
from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.group import init_group, launch_local
from dwdp.runtime.model import DWDPModel
from dwdp.models.tiny import tiny_config
from logits_check import check_logits

H, I, E, K, VOCAB, LAYERS = 32, 24, 8, 2, 64, 2


class GroupedGemm(nn.Module):
    """One projection of every expert, rows already sorted by expert: weight [E, in, out]."""

    def __init__(self, in_features: int, out_features: int, groups: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(groups, in_features, out_features) / in_features ** 0.5)

    def forward(self, input, tokens_per_expert):
        """input [R, in] sorted by expert, tokens_per_expert [E] -> [R, out]."""
        out = input.new_zeros(input.shape[0], self.weight.shape[-1])
        ends = torch.cumsum(tokens_per_expert, 0).tolist()
        for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
            out[start:end] = input[start:end] @ self.weight[e]
        return out


class OlderAriaExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = GroupedGemm(H, 2 * I, E)   # [E, H, 2I]
        self.fc2 = GroupedGemm(I, H, E)       # [E, I, H]

    def route_tokens_to_experts(self, router_logits):
        top_logits, top_indices = torch.topk(router_logits, k=K, dim=1)  # [T, k]
        return top_indices, nn.functional.softmax(top_logits, dim=-1)

    def forward(self, hidden_states, router_logits):
        """hidden_states [T, H], router_logits [T, E] -> [T, H]."""
        top_k_index, top_k_weights = self.route_tokens_to_experts(router_logits)          # [T, k] each
        tokens_per_expert = torch.bincount(top_k_index.flatten(), minlength=E)            # [E]
        sorted_indices = torch.argsort(top_k_index.flatten(), stable=True)                # [T * k]
        h = self.fc1(hidden_states[sorted_indices // K], tokens_per_expert)               # [T * k, 2I]
        projection, gate = h.chunk(2, dim=-1)
        out = self.fc2(nn.functional.silu(projection) * gate, tokens_per_expert)         # [T * k, H]
        unsorted = torch.zeros_like(out).index_copy_(0, sorted_indices, out).view(-1, K, H)
        return (unsorted * top_k_weights.unsqueeze(-1)).sum(dim=1)


class MoELayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = OlderAriaExperts()

    def forward(self, x):
        flat = x.reshape(-1, H)                                                          # [T, H]
        return x + self.experts(flat, self.router(flat)).view(x.shape)


class TinyModel(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, H)
        self.layers = nn.ModuleList(MoELayer() for _ in range(LAYERS))
        self.head = nn.Linear(H, VOCAB, bias=False)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids):
        x = self.embed(input_ids)                                                        # [B, S, H]
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_rebuilt_module_computes_what_the_installed_releases_own_does():
    """Where the installed release still holds Aria's experts this way, the module rebuilt here gives
    the same output as transformers' own on the same weights and inputs."""
    from transformers.models.aria import modeling_aria

    if not hasattr(modeling_aria, "AriaGroupedExpertsGemm"):
        pytest.skip(f"transformers {transformers.__version__} holds Aria's experts decorated (gate_up_proj / "
                    "down_proj): the experts interface adapter takes them")
    config = tiny_config("aria", hidden=H, intermediate=I, num_experts=E, top_k=K)
    own, rebuilt = modeling_aria.AriaExperts(getattr(config, "text_config", config)), OlderAriaExperts()
    gen = torch.Generator().manual_seed(5)
    weights = {name: torch.randn(t.shape, generator=gen) for name, t in own.state_dict().items()}  # fc1, fc2
    own.load_state_dict(weights)
    rebuilt.load_state_dict(weights)
    x, logits = torch.randn(7, H, generator=gen), torch.randn(7, E, generator=gen)  # [T, H], [T, E]
    with torch.no_grad():
        want, got = own(x, logits), rebuilt(x, logits)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_older_aria_experts_are_taken_by_their_adapter():
    layers = find_experts(TinyModel(seed=0))
    assert [layer.name for layer in layers] == ["layers.0.experts", "layers.1.experts"]
    spec = layers[0].spec
    assert layers[0].label.startswith("Aria"), layers[0].label
    assert [(t.name, t.param, t.shape) for t in spec.tensors] == [("fc1", "fc1.weight", (H, 2 * I)),
                                                                    ("fc2", "fc2.weight", (I, H))]
    assert spec.num_experts == E and spec.math.transposed == {"fc1", "fc2"} and spec.hidden_size == H


def test_mismatched_projections_are_refused_by_name():
    model = TinyModel(seed=0)
    model.layers[0].experts.fc2.weight = nn.Parameter(torch.randn(E, I + 1, H))
    with pytest.raises(Unsupported, match=r"layers.0.experts \(OlderAriaExperts\) cannot be wrapped: fc2.weight "
                                          r"has shape \[8, 25, 32\] next to fc1.weight \[8, 32, 48\]"):
        find_experts(model)


def _rank(rank: int) -> dict:
    torch.set_num_threads(1)
    model = TinyModel(seed=3).eval()
    ids = torch.randint(0, VOCAB, (2, 5 + 2 * rank), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        reference = model(ids)
        with DWDPModel(model, DWDPConfig(slice_bytes=4096), init_group()) as wrapped:
            got = wrapped(ids)
            again = wrapped(ids)
            copied = wrapped.stats.bytes_copied
    return dict(diff=max((got - reference).abs().max().item(), (again - reference).abs().max().item()),
                scale=reference.abs().max().item(), bytes_copied=copied)


@pytest.mark.timeout(120)
def test_wrapped_on_two_ranks_matches_the_modules_own_forward():
    for rank, r in enumerate(launch_local(_rank, 2, timeout_s=100)):
        check_logits("older aria", r, rank)
        assert r["bytes_copied"] > 0, f"rank {rank}: nothing was prefetched ({r})"
