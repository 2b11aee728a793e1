#!/usr/bin/env python3
"""kvtier serve through the official `openai` Python client.

Usage: test_openai_client.py BASE_URL MODEL
   or: KVTIER_BASE_URL=... KVTIER_MODEL=... test_openai_client.py

BASE_URL is the server's root (http://127.0.0.1:PORT); the client talks to
BASE_URL/v1. Completes a chat, streams one, reads
usage.prompt_tokens_details.cached_tokens > 0 on a repeated long prompt,
lists the model, and checks that a bad request raises the client's
BadRequestError. Exits non-zero on any failure.
"""

import os
import sys

import openai


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def main():
    base = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("KVTIER_BASE_URL")
    model = sys.argv[2] if len(sys.argv) > 2 else os.environ.get("KVTIER_MODEL")
    if not base or not model:
        print(__doc__, file=sys.stderr)
        return 2
    client = openai.OpenAI(base_url=base.rstrip("/") + "/v1", api_key="none", max_retries=0)
    print(f"openai {openai.__version__} against {base} ({model})")

    ids = [m.id for m in client.models.list().data]
    check(model in ids, f"/v1/models lists {ids}, not {model}")

    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Say hello to kvtier."},
    ]
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0
    )
    choice = chat.choices[0]
    check(chat.object == "chat.completion", f"object {chat.object}")
    check(choice.message.role == "assistant", f"role {choice.message.role}")
    check(isinstance(choice.message.content, str), "content is a string")
    check(choice.finish_reason in ("stop", "length"), f"finish {choice.finish_reason}")
    check(chat.usage.prompt_tokens > 0, f"usage {chat.usage}")
    check(1 <= chat.usage.completion_tokens <= 16 or choice.finish_reason == "stop",
          f"usage {chat.usage}")
    print(f"chat: {choice.finish_reason}, usage {chat.usage.model_dump()}")

    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage, chunks = [], None, None, 0
    for chunk in stream:
        chunks += 1
        check(chunk.object == "chat.completion.chunk", f"chunk object {chunk.object}")
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                pieces.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    streamed = "".join(pieces)
    check(finish in ("stop", "length"), f"streamed finish {finish}")
    check(streamed == choice.message.content,
          f"greedy stream {streamed!r} != reply {choice.message.content!r}")
    check(usage is not None and usage.completion_tokens == chat.usage.completion_tokens,
          f"stream usage {usage}")
    print(f"stream: {chunks} chunks, {finish}")

    long_text = " ".join(f"Fact {i}: kvtier keeps KV blocks in G1, G2 and G3." for i in range(5))
    long_messages = [{"role": "user", "content": long_text}]
    first = client.chat.completions.create(
        model=model, messages=long_messages, max_tokens=4, temperature=0
    )
    check(first.usage.prompt_tokens > 64, f"long prompt has {first.usage.prompt_tokens} tokens")
    second = client.chat.completions.create(
        model=model, messages=long_messages, max_tokens=4, temperature=0
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    check(cached is not None and cached > 0, f"cached_tokens {cached} on the repeat")
    check(second.choices[0].message.content == first.choices[0].message.content,
          "restored prefix gives the recomputed reply")
    print(f"repeat: {cached} of {second.usage.prompt_tokens} prompt tokens cached")

    for _ in range(2):
        comp = client.completions.create(
            model=model, prompt=long_text, max_tokens=4, temperature=0
        )
    check(comp.object == "text_completion", f"object {comp.object}")
    check(comp.usage.prompt_tokens_details.cached_tokens > 0,
          f"completion cached {comp.usage.prompt_tokens_details}")
    print(f"completion: cached {comp.usage.prompt_tokens_details.cached_tokens}")

    try:
        client.completions.create(model=model, prompt="hi", max_tokens=0)
        raise AssertionError("max_tokens=0 was accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400, f"status {e.status_code}")
        print(f"bad request: {e.status_code} {e.message}")
    try:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError as e:
        check(e.status_code == 404, f"status {e.status_code}")

    print("ok")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (AssertionError, openai.OpenAIError) as e:
        print(f"FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
