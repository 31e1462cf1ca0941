"""Tolerances and the logits comparison shared by the multi-process model tests."""
ATOL, RTOL = 1e-5, 1e-5          # fp32 logits, relative to the largest logit
BF16_ATOL, BF16_RTOL = 2e-2, 2e-2


def check_logits(name: str, r: dict, rank: int, atol: float = ATOL, rtol: float = RTOL) -> None:
    """r holds a rank's max |logit difference| ("diff") and its largest reference logit ("scale")."""
    bound = atol + rtol * r["scale"]
    assert r["diff"] <= bound, f"{name} rank {rank}: max|diff|={r['diff']:.3e} > {bound:.3e}"
