"""Wrong models, groups and settings fail at once with an error that names the bad value."""
import pytest
import torch

from dwdp.config import DWDPConfig
from dwdp.experts import dwdp_experts_forward
from dwdp.group import DWDPGroup, init_group
from dwdp.model import DWDPModel
from dwdp.tiny import build_tiny_model


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
    with pytest.raises(ValueError, match="no MoE layers"):
        DWDPModel(dense, DWDPConfig(), DWDPGroup(0, 1))


def test_unsupported_family():
    from transformers import AutoModelForCausalLM, LlamaConfig

    llama = AutoModelForCausalLM.from_config(
        LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    )
    with pytest.raises(ValueError, match="model_type='llama' is not supported"):
        DWDPModel(llama, DWDPConfig(), DWDPGroup(0, 1))


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
