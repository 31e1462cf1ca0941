"""Save a tiny random-weight MoE checkpoint and an offline tokenizer that dwdp and vLLM both load.

    python examples/save_tiny_checkpoint.py /tmp/tiny-moe [--family qwen3_moe] [--seed 0] [--dtype float32]

qwen3_moe (the default): a Qwen3-MoE of hidden size 128 (4 query heads and 2 kv heads of 32: the CPU
attention backend of vLLM takes head sizes 32 and up), 2 layers of 8 experts (top-2). deepseek_v3: an
MLA model of the same width with DeepSeek-V3's attention dims (kv_lora_rank 512 and rope dims 64: the
only latent vLLM's CPU MLA kernel takes; 128 nope and value dims, q_lora_rank 1536), a dense first
layer and a MoE second one. Both with a vocabulary
of 512 and 4096 positions, saved in the checkpoint layout transformers and vLLM read (one tensor per
expert), with a word-level tokenizer over "w4" .. "w511" (ids 0-3: [PAD], [BOS], [EOS], [UNK]) so
every id decodes, and a chat template in those words. Nothing is downloaded. `dwdp serve --model DIR` names the model after the directory.
"""
from __future__ import annotations

import argparse
import sys

import torch

SHAPE = dict(hidden=128, intermediate=128, num_experts=8, top_k=2, num_layers=2, vocab=512,
             max_position_embeddings=4096)
FAMILIES = {
    "qwen3_moe": dict(num_key_value_heads=2),
    # DeepSeek-V3's own attention dims (smaller ones make vLLM's CPU MLA disagree with transformers), router
    # method and scoring (vLLM reads the router's score-correction bias only with them).
    "deepseek_v3": dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                        q_lora_rank=1536, topk_method="noaux_tc", scoring_func="sigmoid"),
}


# Chat in words of the vocabulary: [BOS], then each message as its role's word (w4 system, w5 user, w6
# assistant), its text and w7; the generation prompt is w6 (the assistant's turn).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}w4{% elif m['role'] == 'user' %}w5"
    "{% else %}w6{% endif %} {{ m['content'] }} w7 {% endfor %}{% if add_generation_prompt %}w6{% endif %}")


def save_tokenizer(path: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, "[UNK]": 3, **{f"w{i}": i for i in range(4, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # words joined by spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", bos_token="[BOS]",
                            eos_token="[EOS]", chat_template=CHAT_TEMPLATE).save_pretrained(path)


def save_tiny_checkpoint(path: str, family: str = "qwen3_moe", seed: int = 0,
                         dtype: torch.dtype = torch.float32) -> None:
    from dwdp.models.tiny import build_tiny_model

    model = build_tiny_model(family, seed=seed, dtype=dtype, **SHAPE, **FAMILIES[family])
    model.save_pretrained(path)
    save_tokenizer(path, SHAPE["vocab"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory to write (config.json, model.safetensors, tokenizer)")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_moe")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    args = parser.parse_args()
    save_tiny_checkpoint(args.out, args.family, args.seed, getattr(torch, args.dtype))
    print(f"saved a tiny {args.family} checkpoint and tokenizer in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
