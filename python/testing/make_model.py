"""Makes a small random Llama model in Hugging Face format, with a BPE
tokenizer trained by ``tokenizers`` on generated text: no download.
Shared by the Python checks (python/vllm_tests imports it from here).

    python make_model.py DIR [--size tiny|100m] [--seed N]

``tiny`` (4 layers, hidden 256, head_dim 64, 2 KV heads; starts fast) is the
end-to-end tests' model; ``100m`` (12 layers, hidden 768, head_dim 64,
about 100 M parameters) is scripts/bench-vllm's. head_dim 64: vLLM's CPU
attention takes 32, 64, 80, 96, 112, 128, ...
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

#: Words the tokenizer is trained on and the prompts are made of.
WORDS = [
    "".join(random.Random(i).choice("abcdefghijklmnopqrstuvwxyz") for _ in range(2 + i % 7))
    for i in range(1500)
]

SIZES = {
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=2048),
    "100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4, vocab_size=8192),
}


def text(seed: int, words: int) -> str:
    """A reproducible text of ``words`` words drawn from :data:`WORDS`."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def make(dir: Path, size: str, seed: int) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    dims = SIZES[size]
    dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=dims["vocab_size"],
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((text(i, 200) for i in range(300)), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(dir)
    torch.manual_seed(seed)
    config = LlamaConfig(
        **{**dims, "vocab_size": tok.get_vocab_size()},
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    # Larger weights than the default init: a random model whose logits are
    # not all near-equal, so greedy outputs differ when the KV differs.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(dir, safe_serialization=True)
    (dir / "kvtier-model.json").write_text(json.dumps({"size": size, "seed": seed}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    make(a.dir, a.size, a.seed)


if __name__ == "__main__":
    main()
