#!/usr/bin/env python3
"""Makes a small Llama whose next-token choices are confident and come from
attention over its context: the model to read a KV codec's greedy
agreement on, where random-weight models (whose top-1/top-2 gaps
are tiny) cannot say anything (docs/results.md, "KV codecs").

It starts as `python/testing/make_model.py`'s `tiny` Llama (4 layers,
hidden 256, 2 KV heads of 64, its byte-level BPE tokenizer, 2,048 ids) and
is trained with `torch` on a copy language: each token repeats the one
`--period` positions back with probability 0.9, else is drawn at random
from the whole vocabulary. A model that learned it predicts "the token
`period` back" in any context (the bench's word-salad prompts too) by
attending to it, with a margin of about ln(0.9 * V / 0.1), so a codec that
blurs the restored keys or values shows up as changed tokens only if it
moves attention or the copied value that far.

    python scripts/train-copy-model.py DIR [--steps 400] [--period 5] [--seed 0]
                                           [--arch llama|qwen2|qwen3]

`--arch` picks the family (make_model.py's architectures; a Qwen model
gets its family's tokenizer and chat template, which the bench's plain
prompts do not use).

Needs torch, transformers and tokenizers (the test environment has them).
Prints the training loss and, on held-out sequences, how often the
model's top-1 is the rule's token and the median top-1/top-2 gap.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python" / "testing"))
from make_model import make  # noqa: E402


#: The tokenizer style of each family (make_model.py's `chat`; None is its
#: plain Llama tokenizer, the one trained before `--arch` existed).
CHAT: dict[str, str | None] = {"llama": None, "qwen2": "qwen2", "qwen3": "chatml"}


def batch(gen: torch.Generator, n: int, length: int, period: int, vocab: int) -> torch.Tensor:
    """`n` sequences of the copy language, `length` ids each."""
    x = torch.randint(0, vocab, (n, length), generator=gen)
    keep = torch.rand((n, length), generator=gen) < 0.9
    for t in range(period, length):
        x[:, t] = torch.where(keep[:, t], x[:, t - period], x[:, t])
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--period", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--length", type=int, default=256, help="training sequence length")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--arch", choices=sorted(CHAT), default="llama")
    a = ap.parse_args()
    if a.steps < 1 or a.period < 1 or a.length <= a.period or a.batch < 1:
        ap.error("--steps and --batch must be positive, --length above --period >= 1")

    make(a.dir, "tiny", a.seed, arch=a.arch, chat=CHAT[a.arch])
    model = AutoModelForCausalLM.from_pretrained(a.dir, torch_dtype=torch.float32)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(a.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    model.train()
    for step in range(1, a.steps + 1):
        x = batch(gen, a.batch, a.length, a.period, vocab)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == a.steps:
            print(f"step {step}: loss {loss.item():.3f}", file=sys.stderr, flush=True)

    model.eval()
    with torch.no_grad():
        x = batch(gen, 8, 800, a.period, vocab)
        logits = model(input_ids=x).logits[:, a.period - 1 : -1].float()
        top2 = logits.log_softmax(-1).topk(2, dim=-1)
        want = x[:, a.period :]
        rule = x[:, : -a.period]
        follows = (top2.indices[..., 0] == rule).float().mean().item()
        gaps = (top2.values[..., 0] - top2.values[..., 1]).flatten().tolist()
    print(f"held out (8 x 800 tokens): top-1 is the rule's token at {follows:.3f} of positions "
          f"(the text itself follows it at {(want == rule).float().mean().item():.3f}); "
          f"median top-1/top-2 gap {statistics.median(gaps):.2f} nats")
    model.save_pretrained(a.dir, safe_serialization=True)
    print(f"wrote {a.dir}")


if __name__ == "__main__":
    main()
