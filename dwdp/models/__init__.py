"""What a model is made of, before any rank runs it.

The MoE `families` transformers ships and how each declares its experts, `adapters/` for experts
modules with another interface, the named `expert_tensors` of one expert, `quantization` of experts
(fp8 block scales, MXFP4), checkpoint `loading`, and the tiny random-weight models the demo and the
tests build (`tiny`, `tiny_quantized`, `demo_model`).

May import: `dwdp.kernels` (block-scale formats) and the leaves `dwdp.envs`, `dwdp.versions`.
"""
