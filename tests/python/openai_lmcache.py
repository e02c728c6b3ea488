"""Drives an LMCACHE_PD endpoint with the real `openai` Python client: the router re-shapes
the decoder's completions into the client's own API, and the client must read it.

Usage: python openai_lmcache.py BASE_URL MODEL EXPECTED_TEXT_OF_6_TOKENS
Prints "all ok" when chat and completions, streamed or not, all read back.
"""

import sys

from openai import OpenAI


def main() -> None:
    base_url, model, expected = sys.argv[1], sys.argv[2], sys.argv[3]
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)
    prompt = "tell me " + "hello " * 40

    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=6
    )
    assert chat.object == "chat.completion", chat
    assert chat.choices[0].message.role == "assistant", chat
    assert chat.choices[0].message.content == expected, chat
    assert chat.usage.completion_tokens == 6, chat.usage

    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "again " + prompt}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage, ids = [], None, set()
    for chunk in stream:
        ids.add(chunk.id)
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == expected, pieces
    assert len(ids) == 1, ids
    assert usage is not None and usage.completion_tokens == 6, usage

    completion = client.completions.create(model=model, prompt=prompt, max_tokens=6)
    assert completion.choices[0].text == expected, completion
    stream = client.completions.create(model=model, prompt="more " + prompt, max_tokens=6, stream=True)
    texts = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert "".join(texts) == expected, texts
    print("all ok")


if __name__ == "__main__":
    main()
