"""What transformers computes for a prompt, and the comparison of kvtier's
answers with it.

The reference is the plainest form of greedy decoding: for each of the
``steps`` tokens, the whole sequence so far goes through the model (no KV
cache, eager attention, float32) and the last position's logits become
log-probabilities (``log_softmax``, float32) — the raw model's, before any
sampling transform, as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

#: How far kvtier's log-probabilities may be from transformers'.
LOGPROB_TOL = 1e-3
#: A prompt is usable when, at every step, the greedy token's logprob
#: exceeds the runner-up's by more than this (no near-ties: float noise
#: cannot flip the choice).
MIN_MARGIN = 1e-2


@dataclass(frozen=True)
class Reference:
    """transformers' greedy continuation of ``prompt_ids``."""

    prompt_ids: list[int]
    #: The greedy tokens.
    tokens: list[int]
    #: Per step, the log-probabilities over the whole vocabulary.
    logprobs: list[torch.Tensor]

    @property
    def margins(self) -> list[float]:
        """Per step, top-1 minus top-2 logprob."""
        out = []
        for lp in self.logprobs:
            top2 = torch.topk(lp, 2).values
            out.append(float(top2[0] - top2[1]))
        return out

    def clear(self) -> bool:
        """No step is a near-tie."""
        return min(self.margins) > MIN_MARGIN

    def top(self, step: int, k: int) -> list[tuple[int, float]]:
        """The ``k`` most likely tokens of ``step`` with their logprobs."""
        t = torch.topk(self.logprobs[step], k)
        return [(int(i), float(v)) for v, i in zip(t.values, t.indices, strict=True)]

    def logprob(self, step: int, token: int) -> float:
        return float(self.logprobs[step][token])


@torch.no_grad()
def greedy(model: Any, prompt_ids: list[int], steps: int) -> Reference:
    """``steps`` greedy tokens after ``prompt_ids`` with their logprobs.
    On one thread: these models are small, and torch's threads slow down
    badly when the machine's cores are busy (the server, a build)."""
    seq = list(prompt_ids)
    tokens: list[int] = []
    logprobs: list[torch.Tensor] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(steps):
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            lp = torch.log_softmax(logits, dim=-1)
            tok = int(torch.argmax(lp))
            tokens.append(tok)
            logprobs.append(lp)
            seq.append(tok)
    finally:
        torch.set_num_threads(threads)
    return Reference(list(prompt_ids), tokens, logprobs)


def token_id(s: str) -> int:
    """The id of a ``token_id:<id>`` string (vLLM's
    ``return_tokens_as_token_ids``)."""
    assert s.startswith("token_id:"), f"{s!r} is not a token_id:<id> string"
    return int(s.removeprefix("token_id:"))


def check_top(ref: Reference, step: int, got: dict[int, float], where: str) -> None:
    """One step's top-5 from kvtier (token id -> logprob) against the
    reference: every listed token's logprob within :data:`LOGPROB_TOL` of
    transformers', and every token clearly inside transformers' top-5
    (above the 6th by more than twice the tolerance) listed."""
    assert len(got) == 5, f"{where}: {len(got)} top logprobs, not 5: {got}"
    for tok, lp in got.items():
        want = ref.logprob(step, tok)
        assert abs(lp - want) <= LOGPROB_TOL, (
            f"{where}: token {tok} logprob {lp:.6f}, transformers {want:.6f} "
            f"(diff {lp - want:.2e}); transformers' top-6 {ref.top(step, 6)}"
        )
    top6 = ref.top(step, 6)
    for tok, lp in top6[:5]:
        if lp > top6[5][1] + 2 * LOGPROB_TOL:
            assert tok in got, f"{where}: token {tok} ({lp:.6f}) missing from {got}; transformers' top-6 {top6}"


def check_completion_logprobs(ref: Reference, logprobs: dict[str, Any], where: str) -> None:
    """A legacy-completions ``logprobs`` object, asked with
    ``return_tokens_as_token_ids``, against the reference: the same greedy
    ids, each chosen token's logprob and each step's top-5 within the
    tolerance."""
    got = [token_id(t) for t in logprobs["tokens"]]
    if got != ref.tokens:
        pairs = enumerate(zip(got, ref.tokens, strict=False))
        first = next((i for i, (a, b) in pairs if a != b), min(len(got), len(ref.tokens)))
        raise AssertionError(
            f"{where}: greedy tokens differ from step {first}:\n kvtier       {got}\n transformers {ref.tokens}\n"
            f" transformers' top-3 at that step: {ref.top(first, 3) if first < len(ref.tokens) else None}"
        )
    assert len(logprobs["token_logprobs"]) == len(ref.tokens), logprobs["token_logprobs"]
    assert len(logprobs["top_logprobs"]) == len(ref.tokens), logprobs["top_logprobs"]
    assert len(logprobs["text_offset"]) == len(ref.tokens), logprobs["text_offset"]
    steps = zip(ref.tokens, logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True)
    for i, (tok, lp, top) in enumerate(steps):
        want = ref.logprob(i, tok)
        assert abs(lp - want) <= LOGPROB_TOL, f"{where} step {i}: token {tok} logprob {lp:.6f}, transformers {want:.6f}"
        check_top(ref, i, {token_id(k): v for k, v in top.items()}, f"{where} step {i}")


def check_values(ref: Reference, step: int, got: list[float], where: str) -> None:
    """A step's top-5 logprob values (no ids) against the reference's: the
    k-th largest within the tolerance of transformers' k-th largest (which
    holds whichever of two near-tied tokens is listed)."""
    assert len(got) == 5, f"{where}: {len(got)} top logprobs, not 5: {got}"
    want = [lp for _, lp in ref.top(step, 5)]
    for j, (lp, w) in enumerate(zip(sorted(got, reverse=True), want, strict=True)):
        assert abs(lp - w) <= LOGPROB_TOL, (
            f"{where}: top logprob #{j} {lp:.6f}, transformers {w:.6f}; transformers' top-6 {ref.top(step, 6)}"
        )
