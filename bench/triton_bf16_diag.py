"""Why the single-rank Triton path missed the bf16 bound on 4 families in `pytest -m gpu` (H200, 2026-11-27):
each family's tiny model in fp32 and in bf16, wrapped in a one-rank DWDPModel with experts_kernel "triton"
and "reference" (our plain-PyTorch path), max |logits| against transformers' eager experts and the largest
logit. Needs a CUDA GPU. Usage: python3 bench/triton_bf16_diag.py FAMILY [FAMILY ...]
Its one run: bench/results/triton_bf16_diag_h200.txt."""
import json, sys, torch
from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.group import DWDPGroup
from dwdp.runtime.model import DWDPModel
from dwdp.models.tiny import build_tiny_model

out = {}
for family in sys.argv[1:]:
    row = {}
    for dtype in (torch.float32, torch.bfloat16):
        ids = torch.randint(3, 128, (2, 37), generator=torch.Generator().manual_seed(1)).cuda()
        for kernel in ("triton", "reference"):
            try:
                model = build_tiny_model(family, seed=3, dtype=dtype, initializer_range=0.02).cuda()
                if hasattr(model, "set_experts_implementation"):
                    model.set_experts_implementation("eager")
                with torch.no_grad():
                    torch.manual_seed(0); o = model(input_ids=ids)
                    want = (o.logits if getattr(o, "logits", None) is not None else o[0]).float()
                    with DWDPModel(model, DWDPConfig(experts_kernel=kernel, backend="cuda"), DWDPGroup(0, 1)) as w:
                        torch.manual_seed(0); o = w(input_ids=ids)
                        got = (o.logits if getattr(o, "logits", None) is not None else o[0]).float()
                row[f"{str(dtype)[6:]} {kernel}"] = [round((got - want).abs().max().item(), 6), round(want.abs().max().item(), 3)]
            except Exception as e:
                row[f"{str(dtype)[6:]} {kernel}"] = f"{type(e).__name__}: {e}"[:200]
    out[family] = row
    print(family, json.dumps(row), flush=True)
