"""Drives a Switchyard router with the real `openai` Python client.

Usage: python openai_client.py BASE_URL   (e.g. http://127.0.0.1:8080/v1)
Prints "all ok" when chat and completions, streaming and not, all work.
"""

import sys

from openai import OpenAI


def main() -> None:
    base_url = sys.argv[1]
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)

    chat = client.chat.completions.create(
        model="chat",
        messages=[
            {"role": "system", "content": "You are a support agent for Example Corp. " * 40},
            {"role": "user", "content": "Where is my order?"},
        ],
        max_tokens=5,
    )
    assert chat.choices[0].message.content, chat
    assert chat.usage.completion_tokens == 5, chat.usage
    print("chat:", chat.choices[0].message.content)

    stream = client.chat.completions.create(
        model="chat",
        messages=[{"role": "user", "content": "Stream please"}],
        max_tokens=6,
        stream=True,
    )
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert len([p for p in pieces if p]) >= 2, pieces
    print("chat stream:", "".join(pieces))

    completion = client.completions.create(model="sim", prompt="Once upon a time", max_tokens=4)
    assert completion.choices[0].text, completion
    print("completion:", completion.choices[0].text)

    stream = client.completions.create(model="sim", prompt="Count:", max_tokens=4, stream=True)
    texts = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert len(texts) >= 2, texts
    print("completion stream:", "".join(texts))

    # prompt_cache_key is accepted (newer clients pass it as extra_body on older versions).
    keyed = client.chat.completions.create(
        model="chat",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=1,
        extra_body={"prompt_cache_key": "tenant-7"},
    )
    assert keyed.choices, keyed

    models = client.models.list()
    assert any(model.id == "chat" for model in models.data), models
    print("all ok")


if __name__ == "__main__":
    main()
