"""kvtier's engine against transformers, the reference implementation.

Models (python/testing/make_model.py, made here in a pytest temporary
directory, ``mini`` size: 2 layers, hidden 128, random weights of std 0.08
and random norm scales and biases, float32 safetensors, a tokenizer of
about 1,000 tokens trained on generated prose):

- ``llama3``: Llama with Llama 3's tokenizer conventions (BOS added to
  text) and Meta's Llama 3 Instruct template;
- ``qwen2``: Qwen2 (q/k/v biases) with Qwen2 Instruct's ChatML template;
- ``qwen3``: Qwen3 (q/k norms, head_dim 64 != hidden/heads, tied
  embeddings) with a plain ChatML template in chat_template.jinja;
- ``phi3``: Phi-3 (fused qkv and gate/up) with a SentencePiece-style
  byte-fallback tokenizer and Phi-3's template; config.json in the
  transformers 4 form (``rope_theta``, ``rope_scaling: null``);
- ``qwen2-yarn``: Qwen2 with ``rope_scaling`` yarn, factor 4 over 256
  original positions (max_position_embeddings 1024), transformers 4 form,
  prompts longer than 256 tokens.

Per model, one ``kvtier serve --model DIR --port 0 --cache-dir CACHE``
(``$KVTIER_BIN``; unset is a failure, not a skip):

- ``/tokenize`` of a dozen texts (capitals, punctuation, digits,
  paragraph breaks, non-ASCII, an emoji) equals ``tokenizer(text)`` of
  transformers' AutoTokenizer on the same directory, with and without
  special tokens; ``/detokenize`` equals ``tokenizer.decode``.
- 16 greedy tokens of ``/v1/completions`` (``temperature 0, logprobs 5,
  return_tokens_as_token_ids, ignore_eos``) equal transformers' greedy
  tokens, and every step's chosen and top-5 logprobs are within 1e-3 of
  transformers' ``log_softmax`` of the logits (compared by token id). The
  prompts are the first 4 of the candidates whose reference has no
  near-tie (top-1 minus top-2 logprob above 1e-2 at all 16 steps); fewer
  than 4 such candidates is a failure, never a skip. The text is compared
  too where the reference's continuation decodes to whole characters.
- ``/tokenize`` with ``messages`` (system + user + assistant + user, and
  without the system message; with and without the generation prompt)
  equals ``apply_chat_template(..., tokenize=True)``; one greedy chat
  completion with ``logprobs``/``top_logprobs 5`` matches transformers on
  that rendering: its logprob values, for byte-level tokenizers its token
  strings, and its text.
- ``logit_bias`` of +100 on a token makes it the greedy choice, and its
  reported logprob is still the raw model's.

Reuse, on ``llama3`` with its own cache directory: a prompt of several
hundred tokens sent twice (the second time ``cached_tokens`` = prompt
tokens - 1), then after SIGTERM (a clean exit) and a new server on the
same cache directory once more (cached tokens = prompt tokens - 1, from
the G2/G3 tiers); all three outputs equal transformers'.

The references run transformers in this process (python/engine_tests/
reference.py). Making the models and every reference took about 40 s on
two cores busy with a build; the server's side adds little (the debug
build answers 16 tokens of these models in tens of milliseconds). Run:

    KVTIER_BIN=target/debug/kvtier pytest python/engine_tests
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvtier_server import KvtierServer
from make_model import make, prose
from reference import (
    LOGPROB_TOL,
    Reference,
    check_completion_logprobs,
    check_values,
    greedy,
    token_id,
)

#: Greedy tokens per request.
STEPS = 16
#: Prompts compared per model.
PROMPTS = 4
#: Candidate prompts per model.
CANDIDATES = 12
#: Candidate conversations for the chat completion.
CHAT_CANDIDATES = 6
#: Yarn: 4x over 256 original positions.
YARN_ORIGINAL = 256
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": YARN_ORIGINAL}


@dataclass(frozen=True)
class Case:
    """One model to check."""

    name: str
    #: make_model.make's keyword arguments.
    make: dict[str, Any]
    #: Words per candidate prompt.
    words: int
    #: Sent as token ids instead of text.
    prompt_ids: bool = False
    #: Prompts must be longer than this many tokens.
    min_prompt_tokens: int = 0


CASES = [
    Case("llama3", dict(arch="llama", chat="llama3", max_position_embeddings=2048), words=24),
    Case("qwen2", dict(arch="qwen2", chat="qwen2", max_position_embeddings=2048), words=24),
    Case("qwen3", dict(arch="qwen3", chat="chatml", max_position_embeddings=2048), words=24),
    Case("phi3", dict(arch="phi3", chat="phi3", max_position_embeddings=4096, legacy_rope_config=True), words=24),
    Case(
        "qwen2-yarn",
        dict(
            arch="qwen2",
            chat="qwen2",
            max_position_embeddings=4 * YARN_ORIGINAL,
            rope_scaling=YARN,
            legacy_rope_config=True,
        ),
        words=230,
        prompt_ids=True,
        min_prompt_tokens=YARN_ORIGINAL,
    ),
]


def candidate_text(case_index: int, i: int, words: int) -> str:
    """Candidate prompt ``i``: prose, every third with characters the
    tokenizer never saw (bytes / byte fallback), every fourth ending in a
    newline."""
    t = prose(1000 * case_index + i, words)
    if i % 3 == 1:
        t += " 🙂 at 21°C"
    if i % 4 == 2:
        t += "\n"
    return t


def conversation(seed: int, system: bool) -> list[dict[str, str]]:
    """system? + user + assistant + user; contents with surrounding
    whitespace (Llama 3's template trims it), newlines and non-ASCII."""
    msgs = [{"role": "system", "content": prose(seed, 8)}] if system else []
    msgs += [
        {"role": "user", "content": "  " + prose(seed + 1, 12) + "\n"},
        {"role": "assistant", "content": prose(seed + 2, 10) + "\nOk."},
        {"role": "user", "content": prose(seed + 3, 9) + " 🙂"},
    ]
    return msgs


def chat_ids(tok: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    ids = tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    return list(ids)


def continuation(tok: Any, ref: Reference) -> str | None:
    """The text the greedy tokens add after the prompt (special tokens
    skipped), or None where it is not whole characters."""
    before = tok.decode(ref.prompt_ids, skip_special_tokens=True)
    full = tok.decode(ref.prompt_ids + ref.tokens, skip_special_tokens=True)
    if "\ufffd" in full or not full.startswith(before):
        return None
    return full[len(before) :]


@dataclass
class Prompt:
    text: str
    ref: Reference


@dataclass
class Model:
    """A made model, its transformers tokenizer and model, and the chosen
    prompts with their references."""

    case: Case
    dir: Path
    tok: Any
    hf: Any
    prompts: list[Prompt] = field(default_factory=list)

    def reference(self, ids: list[int]) -> Reference:
        return greedy(self.hf, ids, STEPS)

    def byte_level(self) -> bool:
        decoder = json.loads((self.dir / "tokenizer.json").read_text())["decoder"]
        return bool(decoder["type"] == "ByteLevel")


def first_clear(refs: Iterator[tuple[Any, Reference]], n: int, what: str) -> list[tuple[Any, Reference]]:
    """The first ``n`` candidates whose reference has no near-tie; fails
    when fewer exist."""
    out, seen, margins = [], 0, []
    for item, ref in refs:
        seen += 1
        margins.append(round(min(ref.margins), 4))
        if ref.clear():
            out.append((item, ref))
            if len(out) == n:
                return out
    raise AssertionError(
        f"{what}: only {len(out)} of {seen} candidates have no near-tie (smallest margins {margins}); need {n}"
    )


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Model]:
    """Makes (once) and loads the model of a case, with its prompts."""
    made: dict[str, Model] = {}

    def get(name: str) -> Model:
        if name in made:
            return made[name]
        index, case = next((i, c) for i, c in enumerate(CASES) if c.name == name)
        dir = tmp_path_factory.mktemp(f"model-{name}")
        make(dir, "mini", seed=1 + index, random_vectors=True, **case.make)
        tok = AutoTokenizer.from_pretrained(dir)
        hf = AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32, attn_implementation="eager")
        m = Model(case, dir, tok, hf)

        def candidates() -> Iterator[tuple[str, Reference]]:
            for i in range(CANDIDATES):
                text = candidate_text(index, i, case.words)
                ids = tok(text)["input_ids"]
                if len(ids) > case.min_prompt_tokens:
                    yield text, m.reference(ids)

        m.prompts = [Prompt(t, r) for t, r in first_clear(candidates(), PROMPTS, f"{name} prompts")]
        made[name] = m
        return m

    return get


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.name)
def model(request: pytest.FixtureRequest, models: Callable[[str], Model]) -> Model:
    return models(request.param.name)


@pytest.fixture(scope="module")
def server(model: Model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvtierServer]:
    root = tmp_path_factory.mktemp(f"serve-{model.case.name}")
    s = KvtierServer(model.dir, root / "cache", root / "serve.log")
    try:
        yield s
        code = s.terminate()
        assert code == 0, f"kvtier serve exited {code} after SIGTERM; stderr:\n{s.stderr()}"
    finally:
        s.kill()


def complete(server: KvtierServer, prompt: str | list[int], **extra: Any) -> dict[str, Any]:
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": STEPS,
        "temperature": 0,
        "logprobs": 5,
        "return_tokens_as_token_ids": True,
        "ignore_eos": True,
        **extra,
    }
    r: dict[str, Any] = server.post("/v1/completions", body)
    return r


def test_tokenize_text(model: Model, server: KvtierServer) -> None:
    tok = model.tok
    raw = Tokenizer.from_file(str(model.dir / "tokenizer.json"))
    index = CASES.index(model.case)
    for i in range(CANDIDATES):
        text = candidate_text(index, i, model.case.words)
        want = tok(text)["input_ids"]
        # The maker's own check: transformers reads tokenizer.json as the
        # tokenizers library does (which a server may use directly).
        assert raw.encode(text).ids == want, f"transformers and tokenizers disagree on {text!r}"
        r = server.post("/tokenize", {"prompt": text})
        assert r["tokens"] == want, f"{text!r}\n kvtier       {r['tokens']}\n transformers {want}"
        assert r["count"] == len(want)
        assert r["max_model_len"] == model.hf.config.max_position_embeddings, r["max_model_len"]
        plain = tok(text, add_special_tokens=False)["input_ids"]
        r = server.post("/tokenize", {"prompt": text, "add_special_tokens": False})
        assert r["tokens"] == plain, (
            f"{text!r} without special tokens\n kvtier       {r['tokens']}\n transformers {plain}"
        )
        r = server.post("/detokenize", {"tokens": plain})
        assert r["prompt"] == tok.decode(plain), f"{r['prompt']!r} != {tok.decode(plain)!r}"
    bos = tok.bos_token_id
    if model.case.make["chat"] == "llama3":
        # The tokenizer adds the BOS, once, as published Llama 3 tokenizers do.
        ids = tok("x")["input_ids"]
        assert ids[0] == bos, ids
        assert bos not in ids[1:], ids


def test_greedy_and_logprobs(model: Model, server: KvtierServer) -> None:
    for n, p in enumerate(model.prompts):
        where = f"{model.case.name} prompt {n} ({len(p.ref.prompt_ids)} tokens)"
        assert len(p.ref.prompt_ids) > model.case.min_prompt_tokens
        r = complete(server, p.ref.prompt_ids if model.case.prompt_ids else p.text)
        choice = r["choices"][0]
        assert r["usage"]["prompt_tokens"] == len(p.ref.prompt_ids), (where, r["usage"])
        assert r["usage"]["completion_tokens"] == STEPS, (where, r["usage"])
        assert choice["finish_reason"] == "length", (where, choice["finish_reason"])
        check_completion_logprobs(p.ref, choice["logprobs"], where)
        text = continuation(model.tok, p.ref)
        if text is not None:
            assert choice["text"] == text, f"{where}: text {choice['text']!r}, transformers {text!r}"


def test_chat_template(model: Model, server: KvtierServer) -> None:
    for seed, system in [(7, True), (8, False)]:
        msgs = conversation(seed, system)
        for gen in (True, False):
            want = chat_ids(model.tok, msgs, gen)
            body: dict[str, Any] = {"messages": msgs} if gen else {"messages": msgs, "add_generation_prompt": False}
            r = server.post("/tokenize", body)
            rendered = model.tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
            assert r["tokens"] == want, (
                f"{model.case.name} chat (system: {system}, generation prompt: {gen})\n"
                f" kvtier       {r['tokens']}\n transformers {want}\n"
                f" rendered by transformers: {rendered!r}\n"
                f" kvtier's tokens decoded:  {model.tok.decode(r['tokens'])!r}"
            )
            assert r["count"] == len(want)


def test_chat_completion(model: Model, server: KvtierServer) -> None:
    def candidates() -> Iterator[tuple[list[dict[str, str]], Reference]]:
        for i in range(CHAT_CANDIDATES):
            msgs = conversation(100 + 10 * i, system=i % 2 == 0)
            yield msgs, model.reference(chat_ids(model.tok, msgs))

    [(msgs, ref)] = first_clear(candidates(), 1, f"{model.case.name} chats")
    where = f"{model.case.name} chat"
    r = server.post(
        "/v1/chat/completions",
        {
            "model": server.model,
            "messages": msgs,
            "max_tokens": STEPS,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 5,
            "ignore_eos": True,
        },
    )
    assert r["usage"]["prompt_tokens"] == len(ref.prompt_ids), (where, r["usage"])
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == STEPS, (where, len(content))
    byte_level = model.byte_level()
    for i, (tok, c) in enumerate(zip(ref.tokens, content, strict=True)):
        at = f"{where} step {i}"
        want = ref.logprob(i, tok)
        assert abs(c["logprob"] - want) <= LOGPROB_TOL, (
            f"{at}: logprob {c['logprob']:.6f}, transformers {want:.6f} for token {tok} "
            f"({model.tok.decode([tok])!r}); transformers' top-3 {ref.top(i, 3)}"
        )
        check_values(ref, i, [t["logprob"] for t in c["top_logprobs"]], at)
        s = model.tok.decode([tok])
        if byte_level and "\ufffd" not in s:
            # A byte-level token is its own text wherever it stands.
            assert c["token"] == s, f"{at}: token {c['token']!r}, transformers {s!r} (id {tok})"
            assert c["bytes"] == list(s.encode()), f"{at}: bytes {c['bytes']}"
    text = continuation(model.tok, ref)
    if text is not None:
        got = r["choices"][0]["message"]["content"]
        assert got == text, f"{where}: {got!r}, transformers {text!r}"


def test_logit_bias_picks_the_token(model: Model, server: KvtierServer) -> None:
    ref = model.prompts[0].ref
    special = set(model.tok.all_special_ids)
    target = next(t for t, _ in ref.top(0, 40)[20:] if t not in special)
    prompt = ref.prompt_ids if model.case.prompt_ids else model.prompts[0].text
    r = complete(server, prompt, max_tokens=2, logprobs=1, logit_bias={str(target): 100})
    lp = r["choices"][0]["logprobs"]
    assert token_id(lp["tokens"][0]) == target, (lp["tokens"], target, ref.tokens[0])
    # Reported logprobs are the model's, before the bias.
    assert abs(lp["token_logprobs"][0] - ref.logprob(0, target)) <= LOGPROB_TOL, (
        lp["token_logprobs"][0],
        ref.logprob(0, target),
    )


def test_reuse_same_prompt_and_after_restart(models: Callable[[str], Model], tmp_path: Path) -> None:
    m = models("llama3")

    def long_candidates() -> Iterator[tuple[str, Reference]]:
        for i in range(6):
            text = prose(5000 + i, 320)
            yield text, m.reference(m.tok(text)["input_ids"])

    [(text, ref)] = first_clear(long_candidates(), 1, "reuse prompt")
    n = len(ref.prompt_ids)
    assert n >= 300, n
    cache = tmp_path / "cache"

    def tiers(r: dict[str, Any]) -> dict[str, int]:
        t: dict[str, int] = r["kvtier"]["cached_tokens"]
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == sum(t.values()), (r["usage"], t)
        assert r["usage"]["prompt_tokens"] == n, r["usage"]
        return t

    s = KvtierServer(m.dir, cache, tmp_path / "serve-1.log")
    try:
        first = complete(s, text)
        check_completion_logprobs(ref, first["choices"][0]["logprobs"], "reuse: first request")
        assert sum(tiers(first).values()) == 0, first["kvtier"]
        again = complete(s, text)
        check_completion_logprobs(ref, again["choices"][0]["logprobs"], "reuse: same prompt again")
        t = tiers(again)
        assert sum(t.values()) == n - 1, f"the repeat reused {t} of {n} prompt tokens, not {n - 1}"
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        code = s.terminate()
        assert code == 0, f"kvtier serve exited {code} after SIGTERM; stderr:\n{s.stderr()}"
    finally:
        s.kill()

    s = KvtierServer(m.dir, cache, tmp_path / "serve-2.log")
    try:
        restored = complete(s, text)
        check_completion_logprobs(ref, restored["choices"][0]["logprobs"], "reuse: after a restart")
        t = tiers(restored)
        why = f"after a restart {t} of {n} prompt tokens came from the cache, not {n - 1} from G2/G3; "
        why += f"stderr:\n{s.stderr()}"
        assert t["g2"] + t["g3"] == n - 1, why
        assert t["g1"] == 0, why
        assert restored["choices"][0]["text"] == first["choices"][0]["text"]
        assert s.terminate() == 0
    finally:
        s.kill()
