"""Drives Switchyard routers with the real `openai` Python client on vLLM's other paths: the
Responses API with its stored state, and embeddings.

Usage:
  python openai_responses.py flow BASE_URL_A BASE_URL_B
      Responses (non-streaming and streaming) through router A, follow-ups through router B
      (and back), retrieve, cancel and delete (vLLM's 405) by the wrapped id, a background
      response cancelled through the other router, embeddings, an unknown path.
      Prints "holder INSTANCE" and "kept ID" (a stored response left in place), then "all ok".
  python openai_responses.py gone BASE_URL ID
      The instance that stored ID has left: a follow-up and a retrieval get 404
      response_not_found. Prints "all ok".
"""

import sys

import openai
from openai import OpenAI


def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)


def create(api: OpenAI, **kwargs):
    """responses.create, with the routing headers of its answer."""
    raw = api.responses.with_raw_response.create(model="chat", **kwargs)
    return raw.parse(), raw.headers.get("x-switchyard-instance"), raw.headers.get("x-switchyard-route")


def flow(base_a: str, base_b: str) -> None:
    a, b = client(base_a), client(base_b)

    first, holder, _ = create(
        a,
        instructions="You are a support agent for Example Corp. " * 20,
        input="Where is my order?",
        max_output_tokens=6,
    )
    assert first.id.startswith("resp_sy1"), first.id
    assert first.output_text, first
    assert first.usage.output_tokens == 6, first.usage
    print("first:", first.id, "on", holder, "input tokens", first.usage.input_tokens)

    # Follow-ups alternate between the routers; each reaches the holder and sees every turn.
    previous, seen = first, first.usage.input_tokens + first.usage.output_tokens
    for turn in range(4):
        api = b if turn % 2 == 0 else a
        follow, instance, route = create(
            api, input=f"And what about item {turn}?", previous_response_id=previous.id
        )
        assert instance == holder, (instance, holder)
        assert route == "response", route
        assert follow.previous_response_id == previous.id, follow
        assert follow.usage.input_tokens >= seen, (follow.usage, seen)
        assert follow.id.startswith("resp_sy1") and follow.id != previous.id, follow.id
        previous, seen = follow, follow.usage.input_tokens + follow.usage.output_tokens
    print("follow-ups on", holder, "input tokens", previous.usage.input_tokens)

    # Streaming: every event arrives, the ids in them are wrapped.
    raw = a.responses.with_raw_response.create(
        model="chat", input="Stream please", max_output_tokens=5, stream=True
    )
    streamed_on = raw.headers.get("x-switchyard-instance")
    kinds, deltas, created_id, final = [], [], None, None
    for event in raw.parse():
        kinds.append(event.type)
        if event.type == "response.created":
            created_id = event.response.id
        elif event.type == "response.output_text.delta":
            deltas.append(event.delta)
        elif event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[0] == "response.created" and final is not None, kinds
    assert len(deltas) == 5, deltas
    assert created_id == final.id and final.id.startswith("resp_sy1"), (created_id, final.id)
    assert final.output_text == "".join(deltas), (final.output_text, deltas)
    # A streamed follow-up through the other router continues it on its instance.
    raw = b.responses.with_raw_response.create(
        model="chat", input="More", previous_response_id=final.id, stream=True
    )
    assert raw.headers.get("x-switchyard-instance") == streamed_on
    events = list(raw.parse())
    assert events[-1].response.previous_response_id == final.id, events[-1]
    print("streamed:", final.id, "on", streamed_on)

    # Retrieve, cancel and delete by the wrapped id, through the other router.
    retrieved = b.responses.retrieve(first.id)
    assert retrieved.id == first.id and retrieved.output_text == first.output_text, retrieved
    try:
        b.responses.cancel(first.id)
        raise AssertionError("cancel of a finished response succeeded")
    except openai.BadRequestError as error:
        # The holder's own answer: only it knows the response.
        assert "Cannot cancel" in str(error), error
    # vLLM has no DELETE for responses: its 405 passes through, and the response stays.
    try:
        b.responses.delete(previous.id)
        raise AssertionError("a delete succeeded")
    except openai.APIStatusError as error:
        assert error.status_code == 405, error
    assert a.responses.retrieve(previous.id).id == previous.id

    # Background: queued at once on one router, cancelled through the other while it runs
    # (a long answer; a new one if it finished first), then retrieved cancelled.
    for _ in range(3):
        queued, _, _ = create(a, input="A long story", background=True, max_output_tokens=100000)
        assert queued.status == "queued" and queued.id.startswith("resp_sy1"), queued
        try:
            cancelled = b.responses.cancel(queued.id)
        except openai.BadRequestError:
            continue
        assert cancelled.status == "cancelled" and cancelled.id == queued.id, cancelled
        assert a.responses.retrieve(queued.id).status == "cancelled"
        print("cancelled:", queued.id)
        break
    else:
        raise AssertionError("no background response was still running to cancel")

    # Embeddings (the SDK asks for base64 and decodes it).
    embeddings = a.embeddings.create(model="chat", input=["first text", "second text"])
    assert len(embeddings.data) == 2, embeddings
    assert len(embeddings.data[0].embedding) == 64, len(embeddings.data[0].embedding)
    assert embeddings.data[0].embedding != embeddings.data[1].embedding
    floats = a.embeddings.create(model="chat", input="x", encoding_format="float", dimensions=8)
    assert len(floats.data[0].embedding) == 8, floats

    # Unknown paths answer in OpenAI's shape.
    try:
        a.post("/foo", cast_to=object, body={})
        raise AssertionError("an unknown path answered")
    except openai.NotFoundError as error:
        assert error.code == "unknown_url", error.body

    print("holder", holder)
    print("kept", first.id)
    print("all ok")


def gone(base_url: str, response_id: str) -> None:
    api = client(base_url)
    for attempt in (
        lambda: api.responses.create(model="chat", input="Still there?", previous_response_id=response_id),
        lambda: api.responses.retrieve(response_id),
    ):
        try:
            attempt()
            raise AssertionError("a response whose instance left was found")
        except openai.NotFoundError as error:
            assert error.code == "response_not_found", error.body
            assert "has left" in error.message, error.message
    print("all ok")


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "flow":
        flow(sys.argv[2], sys.argv[3])
    elif mode == "gone":
        gone(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(f"unknown mode {mode}")
