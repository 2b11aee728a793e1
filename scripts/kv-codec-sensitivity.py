#!/usr/bin/env python3
"""How far each KV codec's rounding moves a model's next-token log
probabilities, computed by `transformers` alone: the reference to read
`kvtier bench --kv-offload-codec C`'s accuracy figures against.

For each of `--prompts` random prompts of `--tokens` token ids, the model
computes the KV of all but the last token; the last token's log
probabilities are then computed from that KV as it is and rounded the way
each codec stores it (docs/block-format.md, "Codecs": bf16; fp8-e4m3 and
int8 with a scale per (token, head) row of head_dim values). Prints, per
codec, the largest and median |delta| of the top-5 log probabilities (rank
by rank, as kvtier's bench) and how often the most likely token changed.

    python scripts/kv-codec-sensitivity.py MODEL_DIR [--prompts 16] [--tokens 800]

Needs torch and transformers (the test environment has both).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicCache


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def scaled(top: float, code: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A per-row scaled codec: scale = max|x| / top, x * (1 / scale) coded."""

    def q(x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().amax(dim=-1, keepdim=True) / top
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        return code((x * inv).clamp(-top, top)) * scale

    return q


CODECS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "bf16": bf16,
    "fp8-e4m3": scaled(448.0, lambda y: y.to(torch.float8_e4m3fn).to(torch.float32)),
    "int8": scaled(127.0, torch.round),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=800)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    deltas: dict[str, list[float]] = {c: [] for c in CODECS}
    flips = dict.fromkeys(CODECS, 0)
    gaps: list[float] = []
    with torch.no_grad():
        for _ in range(a.prompts):
            ids = torch.randint(3, vocab, (1, a.tokens))
            kv = [(layer.keys.clone(), layer.values.clone()) for layer in model(ids[:, :-1], use_cache=True).past_key_values.layers]

            def last(q: Callable[[torch.Tensor], torch.Tensor]) -> torch.return_types.topk:
                cache = DynamicCache()
                for i, (k, v) in enumerate(kv):
                    cache.update(q(k), q(v), i)
                return model(ids[:, -1:], past_key_values=cache).logits[0, -1].log_softmax(-1).topk(5)

            ref = last(lambda x: x)
            gaps.append(float(ref.values[0] - ref.values[1]))
            for name, q in CODECS.items():
                got = last(q)
                deltas[name].append(float((got.values - ref.values).abs().max()))
                flips[name] += int(got.indices[0] != ref.indices[0])
    print(f"{a.prompts} prompts of {a.tokens} tokens; the reference's top-1/top-2 gap: median {statistics.median(gaps):.4f}")
    for name in CODECS:
        print(
            f"{name:>9}: max |delta logprob| top-5 {max(deltas[name]):.4f}, median {statistics.median(deltas[name]):.4f}; "
            f"top-1 changed {flips[name]}/{a.prompts}"
        )


if __name__ == "__main__":
    main()
