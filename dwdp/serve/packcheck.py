"""The startup self-check of packed forwards: before a worker reports ready, two short seeded random
prompts run packed into one forward and each alone; the worker serves packed forwards only when
the two agree.

Legend: V = vocabulary, T = tokens of a prompt, Ld = decoder layers, Hkv = key / value heads (the
cache's), D = head dim.

`packing_support` decides from the config alone; this check runs the model the worker will serve
with (a DWDPModel or DEPModel, whose MoE layers are the ones it serves with) through the very
`packed_forward` it will serve with, against the model's own single-prompt forward (its own mask,
no position ids given). It catches what a config does not show: a layer that mixes tokens outside
attention, a model whose logits are not the causal LM's, a mask taken in a format the builder
does not produce. Every rank of a DEP group must run it together (its forwards are collective).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from dwdp.serve.packed import Piece
from dwdp.serve.prefill import model_dtype, packed_forward

log = logging.getLogger("dwdp")

SELF_CHECK_LENGTHS = (5, 3)  # tokens of the two prompts: the second starts mid-row, after the first
SELF_CHECK_SEED = 0

# Packed and alone differ only in the order of float sums; a prompt that sees another prompt's
# tokens moves its logits by a sizeable fraction of their scale (0.1 to 3 for the tiny models).
# (atol, rtol) per dtype, on |packed - alone| against the alone forward's largest magnitude; other
# dtypes take bf16's.
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (2e-2, 2e-2)}


@dataclass(frozen=True)
class SelfCheck:
    """The outcome: whether the packed forward matched, and why not when it did not."""

    is_packed: bool
    reason: str                     # "" when packed; else the mismatch or the exception's first line
    max_dlogit: float | None = None  # largest |packed - alone| over both prompts' last logits
    max_dkv: float | None = None     # largest |packed - alone| over both prompts' keys and values


def self_check_prompts(vocab_size: int, lengths=SELF_CHECK_LENGTHS, seed: int = SELF_CHECK_SEED) -> list[tuple]:
    """Seeded random prompts of `lengths` tokens (ids from 3 up, clear of pad / bos / eos)."""
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(3, vocab_size, (n,), generator=g).tolist()) for n in lengths]


def _alone(model, prompt: tuple, device) -> tuple[torch.Tensor, list]:
    """(last logits [V], Ld pairs of [1, Hkv, T, D]) of `prompt` alone, under the model's own mask."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt], device=device), cache=DynamicCache(), use_cache=True)
    return out.logits[0, -1], [(layer.keys, layer.values) for layer in out.cache.layers]


def _bound(reference: torch.Tensor, dtype: torch.dtype) -> float:
    atol, rtol = TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16])
    return atol + rtol * float(reference.abs().max())


def check_packed_forward(model, lengths=SELF_CHECK_LENGTHS, seed: int = SELF_CHECK_SEED) -> SelfCheck:
    """Run the self-check on `model` (a causal LM, or a DWDPModel / DEPModel around one); never raises
    for what the forwards raise: an exception is a failed check whose reason is its first line."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    prompts = self_check_prompts(int(config.vocab_size), lengths, seed)
    dtype = model_dtype(model)
    device = model.get_input_embeddings().weight.device
    try:
        logits, kv = packed_forward(model, [Piece(i, p, 0) for i, p in enumerate(prompts)], [None] * len(prompts))
        alone = [_alone(model, p, device) for p in prompts]
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        return SelfCheck(False, f"packed self-check: {type(exc).__name__}: {first}")
    dlogit = dkv = 0.0
    failures = []
    for i, (row, new) in enumerate(zip(logits, kv)):
        ref_logits, ref_kv = alone[i]
        d, tol = float((row.float() - ref_logits.float()).abs().max()), _bound(ref_logits, dtype)  # over [V]
        dlogit = max(dlogit, d)
        if d > tol:
            failures.append(f"prompt {i}: max |dlogit| {d:.3g} > tol {tol:.3g}")
        if len(new) != len(ref_kv):
            failures.append(f"prompt {i}: {len(new)} cached layers, {len(ref_kv)} alone")
            continue
        for layer, (pair, ref_pair) in enumerate(zip(new, ref_kv)):
            for name, got, ref in zip(("keys", "values"), pair, ref_pair):
                if got.shape != ref.shape:
                    failures.append(f"prompt {i} layer {layer} {name}: shape {tuple(got.shape)} != alone "
                                 f"{tuple(ref.shape)}")
                    continue
                d, tol = float((got.float() - ref.float()).abs().max()), _bound(ref, dtype)  # over [1, Hkv, T, D]
                dkv = max(dkv, d)
                if d > tol:
                    failures.append(f"prompt {i} layer {layer} {name}: max |d| {d:.3g} > tol {tol:.3g}")
    if failures:
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        return SelfCheck(False, f"packed self-check: {failures[0]}{more}", dlogit, dkv)
    return SelfCheck(True, "", dlogit, dkv)


def worker_forwards(model, config, rank: int) -> tuple[bool, str]:
    """(whether this worker serves packed forwards, why not): `config.packs` (ServeConfig) says
    whether the family may pack at all; a family that may is then self-checked on `model`. Logs the
    outcome in one line."""
    is_packed, why = config.packs(model.config)
    if not is_packed:
        log.info("rank %d: padded forwards (%s)", rank, why)
        return False, why
    check = check_packed_forward(model)
    if not check.is_packed:
        log.warning("rank %d: padded forwards, %s", rank, check.reason)
        return False, check.reason
    log.info("rank %d: packed forwards (self-check: max |dlogit| %.3g, max |dkv| %.3g)", rank, check.max_dlogit,
             check.max_dkv)
    return True, ""
