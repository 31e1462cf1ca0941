import pytest

from dwdp.runtime.config import DWDPConfig


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("group_size", 0, "group_size=0"),
        ("group_size", 2.5, "group_size=2.5"),
        ("num_local_experts", 0, "num_local_experts=0"),
        ("slice_bytes", 0, "slice_bytes=0"),
        ("slice_bytes", -4, "slice_bytes=-4"),
        ("num_buffers", 1, "num_buffers=1"),
        ("num_buffers", True, "num_buffers=True"),
        ("backend", "nccl", "backend='nccl'"),
        ("wait_timeout_s", 0, "wait_timeout_s=0"),
        ("wait_timeout_s", float("inf"), "wait_timeout_s=inf"),
        ("wait_timeout_s", "10", "wait_timeout_s='10'"),
        ("inflight", 0, "inflight=0"),
    ],
)
def test_invalid_value_names_field_and_range(field, value, words):
    with pytest.raises(ValueError) as err:
        DWDPConfig(**{field: value})
    assert words in str(err.value), str(err.value)


def test_defaults():
    cfg = DWDPConfig()
    assert (cfg.slice_bytes, cfg.num_buffers, cfg.backend) == (None, 2, "auto")
    # No slice size given: the backend's (copies on a GPU cost the host per copy, see DEFAULT_SLICE_BYTES).
    assert (cfg.slice_bytes_for("host"), cfg.slice_bytes_for("cuda")) == (1 << 20, 4 << 20)
    assert DWDPConfig(slice_bytes=4096).slice_bytes_for("cuda") == 4096
    with pytest.raises(ValueError, match="backend='auto' has no default slice size"):
        cfg.slice_bytes_for("auto")


def test_frozen_and_json_roundtrip(tmp_path):
    cfg = DWDPConfig(group_size=4, num_local_experts=3, slice_bytes=4096, num_buffers=3, backend="host")
    with pytest.raises(AttributeError):
        cfg.group_size = 2
    cfg.to_json(tmp_path / "c.json")
    assert DWDPConfig.from_json(tmp_path / "c.json") == cfg


def test_json_unknown_field(tmp_path):
    (tmp_path / "c.json").write_text('{"slice_byte": 4}')
    with pytest.raises(ValueError, match="slice_byte"):
        DWDPConfig.from_json(tmp_path / "c.json")
