"""Wrong models, groups and settings fail at once with an error that names the bad value."""
import pytest
import torch

from dwdp.models.adapters import Unsupported
from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.experts import dwdp_experts_forward
from dwdp.runtime.group import DWDPGroup, init_group
from dwdp.runtime.model import DWDPModel
from dwdp.models.tiny import build_tiny_model


@pytest.fixture(scope="module")
def mixtral_state():
    return build_tiny_model("mixtral", seed=1).state_dict()


@pytest.fixture
def mixtral(mixtral_state):
    model = build_tiny_model("mixtral", seed=1)
    model.load_state_dict(mixtral_state)
    return model


def test_model_without_moe_layers():
    dense = build_tiny_model("qwen3_moe", mlp_only_layers=[0, 1, 2])
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM has no MoE experts modules"):
        DWDPModel(dense, DWDPConfig(), DWDPGroup(0, 1))


def test_dense_family():
    from transformers import AutoModelForCausalLM, LlamaConfig

    llama = AutoModelForCausalLM.from_config(
        LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    )
    with pytest.raises(ValueError, match="LlamaForCausalLM has no MoE experts modules"):
        DWDPModel(llama, DWDPConfig(), DWDPGroup(0, 1))


def test_default_gate_without_act_fn_is_refused_not_a_crash(mixtral):
    """Regression: a module with transformers' default gate but no act_fn crashed in uses_default_swiglu."""
    del mixtral.model.layers[1].mlp.experts.act_fn
    with pytest.raises(Unsupported, match=r"model.layers.1.mlp.experts \(MixtralExperts\) cannot be wrapped: act_fn "
                                          r"is missing: the experts apply act_fn\(gate\) \* up"):
        DWDPModel(mixtral, DWDPConfig(), DWDPGroup(0, 1))


def test_expert_weights_of_the_wrong_shape(mixtral):
    experts = mixtral.model.layers[0].mlp.experts
    experts.down_proj = torch.nn.Parameter(torch.randn(8, 32, 40))
    with pytest.raises(Unsupported, match=r"model.layers.0.mlp.experts \(MixtralExperts\) cannot be wrapped: down_proj "
                                          r"has shape \[8, 32, 40\] next to gate_up_proj \[8, 96, 32\]"):
        DWDPModel(mixtral, DWDPConfig(), DWDPGroup(0, 1))


class OddExperts(torch.nn.Module):
    """Stacked [E, out, in] weights behind an interface no adapter knows."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 16, 32))

    def forward(self, x, expert_sizes):
        return x


def test_experts_like_module_no_adapter_takes(mixtral):
    """A module named like experts that nothing wraps is refused by name, class and attribute."""
    mixtral.model.layers[2].mlp = OddExperts()
    with pytest.raises(Unsupported, match=r"model.layers.2.mlp \(OddExperts\) cannot be wrapped: weight "
                                          r"\[8, 16, 32\] is driven by OddExperts.forward\(x, expert_sizes\)"):
        DWDPModel(mixtral, DWDPConfig(), DWDPGroup(0, 1))


def test_layers_with_different_experts(mixtral):
    experts = mixtral.model.layers[2].mlp.experts
    experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj[:, :64].clone())
    experts.down_proj = torch.nn.Parameter(experts.down_proj[..., :32].clone())
    with pytest.raises(ValueError, match=r"model.layers.2.mlp.experts has experts .*expected .* like "
                                         r"model.layers.0.mlp.experts: every MoE layer shares one segment layout"):
        DWDPModel(mixtral, DWDPConfig(), DWDPGroup(0, 1))


def test_bad_expert_biases_value():
    with pytest.raises(ValueError, match="expert_biases='sometimes' is not one of"):
        DWDPConfig(expert_biases="sometimes")


def test_group_larger_than_expert_count(mixtral):
    # Validation happens before any collective, so no process group is needed to see it fail.
    with pytest.raises(ValueError, match=r"group_size=9 must be an int in \[1, num_experts=8\]"):
        DWDPModel(mixtral, DWDPConfig(), DWDPGroup(0, 9))


def test_config_group_size_disagrees_with_group(mixtral):
    with pytest.raises(ValueError, match="config.group_size=2 but the DWDP group has 1 ranks"):
        DWDPModel(mixtral, DWDPConfig(group_size=2), DWDPGroup(0, 1))


def test_too_few_local_experts(mixtral):
    with pytest.raises(ValueError, match="num_local_experts=1 must be in"):
        DWDPModel(mixtral, DWDPConfig(num_local_experts=1), DWDPGroup(0, 4))


def test_cuda_backend_on_a_cpu_model_names_the_device(mixtral):
    with pytest.raises(ValueError, match=r"backend='cuda' needs the model on a CUDA device, found it on cpu"):
        DWDPModel(mixtral, DWDPConfig(backend="cuda"), DWDPGroup(0, 1))


def test_group_rank_out_of_range():
    with pytest.raises(ValueError, match="rank=3"):
        DWDPGroup(3, 2)


def test_group_size_needs_a_distributed_launch(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="group_size=2 needs a distributed launch"):
        init_group(2)


def test_experts_function_on_an_unwrapped_module(mixtral):
    experts = mixtral.model.layers[0].mlp.experts
    with pytest.raises(RuntimeError, match="not wrapped by DWDPModel"):
        dwdp_experts_forward(experts, torch.randn(2, 32), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2))


def test_bad_timeout_env(monkeypatch, mixtral):
    monkeypatch.setenv("DWDP_WAIT_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="DWDP_WAIT_TIMEOUT_S='soon'"):
        DWDPModel(mixtral, DWDPConfig(), DWDPGroup(0, 1))


def test_one_rank_in_process_matches_and_cleans_up(monkeypatch, tmp_path, mixtral):
    monkeypatch.setenv("DWDP_SHM_DIR", str(tmp_path))
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = mixtral(ids).logits
    with DWDPModel(mixtral, DWDPConfig(), DWDPGroup(0, 1)) as wrapped, torch.no_grad():
        torch.testing.assert_close(wrapped(ids).logits, reference, atol=1e-5, rtol=1e-5)
        assert wrapped.config is mixtral.config  # attributes of the model pass through
    assert list(tmp_path.iterdir()) == []


def test_unwrappable_experts_next_to_wrapped_ones_are_refused(mixtral):
    """Experts dwdp cannot handle elsewhere in a layer (say, attention experts) refuse the whole model,
    even when the layer's MLP experts could be wrapped."""
    mixtral.model.layers[1].self_attn.extra = OddExperts()
    with pytest.raises(Unsupported, match=r"model.layers.1.self_attn.extra \(OddExperts\) cannot be wrapped"):
        DWDPModel(mixtral, DWDPConfig(), DWDPGroup(0, 1))
