"""Result-file tags from device names (the names torch reports for each GPU)."""
import pytest
import torch

from dwdp.observe.timing import device_tag


@pytest.mark.parametrize("name, tag", [
    ("NVIDIA GB200", "gb200"),
    ("NVIDIA B200", "b200"),
    ("NVIDIA GH200 480GB", "gh200"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA RTX 6000 Ada Generation", "nvidia_rtx_6000_ada_generation"),
])
def test_cuda_device_tag(monkeypatch, name, tag):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert device_tag("cuda") == tag, (name, device_tag("cuda"))


def test_cpu_tag():
    assert device_tag("cpu") == "cpu"
