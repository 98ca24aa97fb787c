#!/usr/bin/env python3
"""Drives a running `ternfleet serve` with the official `openai` Python package.

Usage: openai_client.py BASE_URL   (e.g. http://127.0.0.1:8080/v1)
Exits non-zero with a message on the first failed check; prints "all checks passed".
"""
import sys

import openai


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)


def main():
    client = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=60)

    models = client.models.list()
    check(len(models.data) == 1 and models.data[0].object == "model", f"models.list: {models}")
    model = models.data[0].id

    # Chat, not streamed.
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
        max_tokens=8,
        temperature=0,
    )
    c = r.choices[0]
    check(r.object == "chat.completion", f"chat object: {r.object}")
    check(c.message.role == "assistant" and isinstance(c.message.content, str), f"chat message: {c.message}")
    check(c.finish_reason in ("stop", "length"), f"chat finish_reason: {c.finish_reason}")
    check(r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 5, f"chat usage: {r.usage}")
    check(r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, "total_tokens")

    # Chat, streamed, usage in the last chunk; the streamed text equals the non-streamed one.
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    check(chunks[0].choices[0].delta.role == "assistant", "first chunk carries the role")
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    check(text == c.message.content, f"streamed {text!r} != {c.message.content!r}")
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    check(len(finals) == 1, "exactly one chunk has a finish_reason")
    check(chunks[-1].choices == [] and chunks[-1].usage is not None, "usage in the last chunk")
    check(chunks[-1].usage.completion_tokens == r.usage.completion_tokens, "streamed usage")
    check(all(ch.usage is None for ch in chunks[:-1]), "usage only in the last chunk")

    # Completions, with logprobs and a stop string.
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=10, temperature=0, logprobs=2)
    c = r.choices[0]
    check(r.object == "text_completion" and isinstance(c.text, str) and c.text, f"completion: {r}")
    check(len(c.logprobs.tokens) == r.usage.completion_tokens, "one logprob per token")
    check(all(len(t) == 2 for t in c.logprobs.top_logprobs), "two alternatives per token")
    check(all(lp <= 0 for lp in c.logprobs.token_logprobs), "log-probabilities are <= 0")
    stop = c.text.strip().split(" ")[0]
    if stop:
        r2 = client.completions.create(model=model, prompt="The capital of France is", max_tokens=10, temperature=0, stop=[stop])
        check(stop not in r2.choices[0].text, f"stop string {stop!r} in {r2.choices[0].text!r}")
        check(r2.choices[0].finish_reason == "stop", "finish_reason stop")

    # Completions, streamed.
    parts = list(client.completions.create(model=model, prompt="The capital of France is", max_tokens=10, temperature=0, stream=True))
    check("".join(p.choices[0].text for p in parts if p.choices) == c.text, "streamed completion text")

    # Errors arrive as OpenAI errors.
    try:
        client.completions.create(model=model, prompt="x", max_tokens=10, temperature=5)
        check(False, "temperature 5 must be refused")
    except openai.BadRequestError as e:
        check("temperature" in str(e), f"error names the field: {e}")

    print("all checks passed")


if __name__ == "__main__":
    main()
