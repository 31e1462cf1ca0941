"""Tiny configs derive the fields that config validators tie to others (RoPE sections from the rotary width)."""
import pytest

from dwdp.models.tiny import split_in_proportion, tiny_config
from releases import family_case


@pytest.mark.parametrize("total, parts, want", [
    (4, [12, 10, 10], [2, 1, 1]), (16, [6, 6, 4], [6, 6, 4]), (8, [2, 3, 3], [2, 3, 3]), (32, [12, 10, 10], [12, 10, 10]),
    (5, [1, 0, 0], [3, 1, 1]),
])
def test_split_in_proportion_sums_to_the_total(total, parts, want):
    got = split_in_proportion(total, parts)
    assert got == want and sum(got) == total, (total, parts, got)


@pytest.mark.parametrize("family, rotary_half", [
    family_case("hy_v4_vl", lambda c: c.qk_rope_head_dim // 2),  # MLA: sections span half the RoPE slice of a head
    ("glm4v_moe", lambda c: int(c.head_dim * c.rope_parameters["partial_rotary_factor"]) // 2),
    ("ernie4_5_vl_moe", lambda c: c.head_dim // 2),
])
def test_rope_sections_follow_the_tiny_rotary_width(family, rotary_half):
    for head in (8, 16):  # two head widths: the sections are derived, not fixed numbers
        config = tiny_config(family, hidden=4 * head)
        text = getattr(config, "text_config", config)
        sections = text.rope_parameters["mrope_section"]
        assert len(sections) == 3 and sum(sections) == rotary_half(text), (family, head, sections)


@pytest.mark.parametrize("family", ["qwen4_exp", "glm5_next"])
def test_hybrid_tiny_configs_use_the_installed_releases_attention_layer_type(family):
    """Their sparse-attention layer type is named differently across releases: a tiny config has the one
    the installed config class itself uses by default, next to linear-attention layers."""
    config = tiny_config(family)
    text = getattr(config, "text_config", config)
    attention = sorted(set(type(text)().layer_types) - {"linear_attention"})
    want = ["linear_attention", *attention, "linear_attention"]
    assert len(attention) == 1 and text.layer_types == want, (family, text.layer_types, want)
