"""Continue generation from a dwdp KV artifact with plain transformers, as a generation server would.

    # a context server answered a prompt with its first token and a KV artifact (kv.path):
    python examples/continue_from_kv.py --artifact KV.safetensors --prompt-ids 5,17,9,... --tokens 8 [--check]

Reads the artifact (dwdp.serve.kv: every layer's keys [1, H, T, Dk] and values [1, H, T, Dv] for
positions 0 .. T-1) into the model's own cache type, DynamicCache(config=model.config) (a
sliding-window layer keeps its last window of it, as it would have kept itself), then lets
`model.generate` go on from the artifact's first token: only that token and the ones after it are
computed, the prompt is never run again. --check runs `generate()` on the whole prompt from scratch
and says whether every token matches. The model is the built-in random-weight preset the server
ran (`--preset`, `--seed`): its weights are the same in every process.
"""
from __future__ import annotations

import argparse
import sys

import torch
from transformers import DynamicCache

from dwdp.serve.kv import read_kv_artifact


def load_cache(path: str, model, model_name: str | None = None) -> tuple[DynamicCache, dict]:
    """The artifact at `path` as `model`'s own cache, and its metadata. Raises ValueError when the
    artifact does not fit the model (model id, layer count, dtype, positions)."""
    layers, meta = read_kv_artifact(path)
    config = model.config.get_text_config()
    if model_name is not None and meta.get("model") != model_name:
        raise ValueError(f"{path}: made by model {meta.get('model')!r}, not {model_name!r}")
    if len(layers) != config.num_hidden_layers:
        raise ValueError(f"{path}: {len(layers)} layers, the model has {config.num_hidden_layers}")
    dtype = model.get_input_embeddings().weight.dtype
    if meta["dtype"] != str(dtype).removeprefix("torch."):
        raise ValueError(f"{path}: dtype {meta['dtype']}, the model runs {dtype}")
    tokens = int(meta["num_tokens"])
    if meta.get("positions", f"0..{tokens - 1}") != f"0..{tokens - 1}":
        raise ValueError(f"{path}: positions {meta['positions']}, expected 0..{tokens - 1}")
    device = model.get_input_embeddings().weight.device
    cache = DynamicCache(config=model.config)
    for index, (keys, values) in enumerate(layers):
        cache.update(keys.to(device), values.to(device), index)  # [1, H, T, Dk], [1, H, T, Dv]
    return cache, meta


def continue_generation(model, path: str, prompt_ids: list[int], num_tokens: int,
                        model_name: str | None = None) -> list[int]:
    """`num_tokens` greedy tokens after `prompt_ids`: the artifact's first token, then `generate`
    from the artifact's cache (the prompt is not recomputed)."""
    cache, meta = load_cache(path, model, model_name)
    if int(meta["num_tokens"]) != len(prompt_ids):
        raise ValueError(f"{path}: holds {meta['num_tokens']} positions, the prompt has {len(prompt_ids)} tokens")
    first = int(meta["first_token_id"])
    if num_tokens == 1:
        return [first]
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([list(prompt_ids) + [first]], device=device)  # [1, T + 1]; generate runs only what the cache lacks
    with torch.inference_mode():
        out = model.generate(ids, cache=cache, max_new_tokens=num_tokens - 1, do_sample=False,
                             attention_mask=torch.ones_like(ids), pad_token_id=model.config.pad_token_id)
    return out[0, len(prompt_ids):].tolist()


def generate_from_scratch(model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """What the unwrapped model's own generate() gives for the whole prompt: the reference."""
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([list(prompt_ids)], device=device)
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=num_tokens, do_sample=False, attention_mask=torch.ones_like(ids),
                             pad_token_id=model.config.pad_token_id)
    return out[0, len(prompt_ids):].tolist()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", required=True, help="a KV artifact's path (the server's kv.path)")
    parser.add_argument("--prompt-ids", required=True, help="the prompt's token ids, comma-separated")
    parser.add_argument("--tokens", type=int, default=8, help="tokens to generate, the first one included")
    parser.add_argument("--preset", default="tiny", help="the server's --preset")
    parser.add_argument("--seed", type=int, default=0, help="the server's --seed")
    parser.add_argument("--check", action="store_true", help="compare with generate() on the whole prompt")
    args = parser.parse_args()
    from dwdp.serve.presets import preset_model

    model = preset_model(args.preset, args.seed)
    prompt = [int(t) for t in args.prompt_ids.split(",")]
    tokens = continue_generation(model, args.artifact, prompt, args.tokens, f"dwdp-{args.preset}")
    print("continued:", tokens)
    if args.check:
        want = generate_from_scratch(model, prompt, args.tokens)
        print("generate():", want, "match" if tokens == want else "MISMATCH")
        return 0 if tokens == want else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
