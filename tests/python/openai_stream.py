"""Reads one streamed chat answer through a Switchyard router with the real `openai` client.

Usage: python openai_stream.py BASE_URL MAX_TOKENS complete EXPECTED_TEXT
       python openai_stream.py BASE_URL MAX_TOKENS broken
`complete`: the stream must read without an error and its text be EXPECTED_TEXT, with one
completion of MAX_TOKENS tokens in its usage. `broken`: the client must raise APIError with the
router's final error event (code upstream_reset). Prints "all ok" at the end.
"""

import sys

import openai
from openai import OpenAI


def main() -> None:
    base_url, max_tokens, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)
    stream = client.chat.completions.create(
        model="chat",
        messages=[{"role": "user", "content": "tell me"}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, ids = "", None, set()
    try:
        for chunk in stream:
            ids.add(chunk.id)
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            if chunk.usage:
                usage = chunk.usage
    except openai.APIError as err:
        assert mode == "broken", f"the stream failed: {err!r}"
        assert "broke off midway" in str(err.message), err
        print("ok: broken stream raised", type(err).__name__)
        print("all ok")
        return
    assert mode == "complete", f"a broken stream read cleanly: {text!r}"
    assert text == sys.argv[4], (text, sys.argv[4])
    assert len(ids) == 1, ids
    assert usage is not None and usage.completion_tokens == max_tokens, usage
    print("ok: migrated stream:", text)
    print("all ok")


if __name__ == "__main__":
    main()
