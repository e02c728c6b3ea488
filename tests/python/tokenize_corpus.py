"""Writes varied OpenAI request bodies, one JSON object per line, for the exactness check of
in-router tokenization (tests/tests/real_vllm.rs): chat and completions, multi-turn, system
prompts, names, text parts, unicode, whitespace, special-token text inside user content,
long prompts, generation-prompt and continue-final-message variants, completions with
add_special_tokens true or false, booleans spelled as pydantic also reads them (1, "yes"),
template kwargs, tools and tool calls. Deterministic for a seed.

Usage: tokenize_corpus.py COUNT SEED [--tools]
Each line: {"kind": "chat" | "completion", "body": {...}} (the body as a client sends it).
"""

import json
import random
import sys

WORDS = (
    "the of and to in is was for on that with as by at from this be are or an it not which "
    "router engine cache prefix token decode prefill fleet batch stream latency instance "
    "naïve café résumé façade Ünïcödé straße smörgåsbord jalapeño "
    "東京 北京 日本語 中文 한국어 русский язык ελληνικά עברית العربية हिन्दी "
    "😀 🚀 👩‍💻 🇫🇷 ✓ → ∑ π ≈ ∞ € £ ¥ © ™ "
    "don't isn't we'll they've I'm "
    "1 23 456 7890 3.14 1e-5 0x1F 2026-12-03 "
    "def fn {} [] () <> ;; :: -> => && || == != "
).split()

SPECIAL_TEXT = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>"]


def text(rng, words):
    out = []
    for _ in range(words):
        roll = rng.random()
        if roll < 0.04:
            out.append(rng.choice(["\n", "\n\n", "\t", "   ", " \n "]))
        elif roll < 0.05:
            out.append(rng.choice(SPECIAL_TEXT))
        else:
            out.append(rng.choice(WORDS))
    joined = " ".join(out)
    if rng.random() < 0.1:
        joined = "  " + joined
    if rng.random() < 0.1:
        joined = joined + rng.choice([" ", "\n", "  \n"])
    return joined


def length(rng):
    roll = rng.random()
    if roll < 0.05:
        return rng.randint(2000, 6000)
    if roll < 0.25:
        return rng.randint(100, 600)
    return rng.randint(1, 40)


def content(rng):
    if rng.random() < 0.2:
        return [{"type": "text", "text": text(rng, length(rng))} for _ in range(rng.randint(1, 3))]
    return text(rng, length(rng))


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Zürich"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 50, "default": 10.0}}},
            "strict": True,
        },
    },
    {"type": "function", "function": {"name": "now"}},
]


def tool_call(rng, index):
    name = rng.choice(["get_weather", "search", "now"])
    arguments = rng.choice(
        [
            json.dumps({"city": rng.choice(WORDS), "unit": "celsius"}),
            json.dumps({"q": text(rng, 3), "limit": rng.randint(1, 50)}, ensure_ascii=False),
            "",
            "{}",
            "not json",
        ]
    )
    return {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": arguments}}


def chat(rng, tools):
    messages = []
    if rng.random() < 0.6:
        messages.append({"role": "system", "content": content(rng)})
    turns = rng.randint(1, 5)
    for turn in range(turns):
        user = {"role": "user", "content": content(rng)}
        if rng.random() < 0.1:
            user["name"] = rng.choice(["alice", "bob_2"])
        messages.append(user)
        if turn == turns - 1:
            break
        if tools and rng.random() < 0.4:
            calls = [tool_call(rng, f"{turn}_{k}") for k in range(rng.randint(1, 2))]
            messages.append({"role": "assistant", "content": None, "tool_calls": calls})
            for call in calls:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": text(rng, 8)})
        else:
            messages.append({"role": "assistant", "content": content(rng)})
    body = {"model": "smol", "messages": messages, "max_tokens": 1}
    roll = rng.random()
    if roll < 0.1:
        body["add_generation_prompt"] = False
    elif roll < 0.2:
        body["messages"].append({"role": "assistant", "content": text(rng, rng.randint(1, 10)).strip() or "Sure"})
        body["add_generation_prompt"] = False
        body["continue_final_message"] = True
    if rng.random() < 0.1:
        body["chat_template_kwargs"] = {"enable_thinking": rng.random() < 0.5}
    if tools and rng.random() < 0.6:
        body["tools"] = rng.sample(TOOLS, rng.randint(1, len(TOOLS)))
    # Fields vLLM's chat completion passes to the template and its /tokenize does not take:
    # the router's /tokenize body carries them in chat_template_kwargs.
    if rng.random() < 0.15:
        body["reasoning_effort"] = rng.choice(["none", "minimal", "low", "medium", "high", "xhigh", "max"])
        if rng.random() < 0.3:
            body.setdefault("chat_template_kwargs", {})["reasoning_effort"] = "overridden"
    if rng.random() < 0.1:
        body["documents"] = [
            {"title": text(rng, 3).strip() or "notes", "text": text(rng, rng.randint(3, 40))}
            for _ in range(rng.randint(1, 3))
        ]
    return loose_flags(rng, body)


def loose_flags(rng, body):
    """Some booleans written as vLLM's request models also read them (pydantic's lax mode)."""
    for name in ("add_generation_prompt", "continue_final_message", "add_special_tokens"):
        if name in body and rng.random() < 0.3:
            spellings = {True: [1, "true", "Yes", "on", "T"], False: [0, "false", "no", "OFF", "f"]}
            body[name] = rng.choice(spellings[body[name]])
    return body


def completion(rng):
    body = {"model": "smol", "prompt": text(rng, length(rng)) or "x", "max_tokens": 1}
    if rng.random() < 0.2:
        body["add_special_tokens"] = rng.random() < 0.5
    return loose_flags(rng, body)


def main():
    count, seed = int(sys.argv[1]), int(sys.argv[2])
    tools = "--tools" in sys.argv[3:]
    rng = random.Random(seed)
    for _ in range(count):
        if rng.random() < 0.25:
            line = {"kind": "completion", "body": completion(rng)}
        else:
            line = {"kind": "chat", "body": chat(rng, tools)}
        print(json.dumps(line, ensure_ascii=False))


if __name__ == "__main__":
    main()
