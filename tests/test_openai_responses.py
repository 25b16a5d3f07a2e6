"""`/v1/responses` (issue 20, item 4) through a real `pie serve` (fp32) with the official
`openai` client: a response, a second one continuing it by `previous_response_id` (its
prompt's KV supplied by the prefix cache, counted in `cached_tokens`), a function call and
its output, streaming, retrieve and delete, and bad requests. The oracle: HF transformers'
greedy output on the same conversation through the chat template."""

from __future__ import annotations

import json

import openai
import pytest

from conftest import hf_greedy
from pie.control.chat_template import render_chat
from pie.server.openai_responses import to_chat
from pie.server.response_store import ResponseStore, Stored
from pie.server.openai import ApiError
from pie_server import TOKEN

MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(pie_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{pie_server.address}/v1", api_key=TOKEN, max_retries=0)


@pytest.fixture(scope="module")
def hf_conversation(hf_model, tokenizer, chat_template):
    """HF greedy text for chat `messages`, until EOS or `max_tokens`."""
    def run(messages: list[dict], max_tokens: int) -> str:
        ids = tokenizer.encode(render_chat(chat_template, messages, True), add_special_tokens=False).ids
        return tokenizer.decode(hf_greedy(hf_model, ids, max_tokens, stop_at=hf_model.config.eos_token_id),
                                skip_special_tokens=False)

    return run


def test_a_conversation_continued_by_previous_response_id(client, hf_conversation):
    first = client.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=40,
                                    temperature=0)
    turn = [{"role": "user", "content": "What is the capital of France?"}]
    assert first.status == "completed" and first.object == "response" and first.id.startswith("resp_")
    assert first.output[0].type == "message" and first.output_text == hf_conversation(turn, 40)
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="And of Germany?",
                                     max_output_tokens=40, temperature=0)
    history = turn + [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And of Germany?"}]
    assert second.output_text == hf_conversation(history, 40) and second.previous_response_id == first.id
    # the earlier prompt and answer were not prefilled again: whole KV pages came from the prefix cache
    assert second.usage.input_tokens_details.cached_tokens >= 16
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, previous_response_id=first.id, input="Hi", max_output_tokens=4)
    assert e.value.body["param"] == "previous_response_id"


def test_a_function_call_and_its_output(client, hf_conversation):
    call = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                   tool_choice="required", parallel_tool_calls=False, max_output_tokens=40,
                                   temperature=0, instructions="Use tools.")
    (item,) = call.output
    assert item.type == "function_call" and item.name == "get_weather" and json.loads(item.arguments)["city"]
    answer = client.responses.create(model=MODEL, previous_response_id=call.id, tools=[WEATHER], temperature=0,
                                     max_output_tokens=24, instructions="Use tools.",
                                     input=[{"type": "function_call_output", "call_id": item.call_id,
                                             "output": "18 C, clear"}])
    assert answer.output[0].type == "message" and answer.output_text
    assert answer.usage.input_tokens_details.cached_tokens >= 16


def test_streamed_events_build_the_same_response(client):
    kwargs = dict(model=MODEL, input="Name three colours.", max_output_tokens=48, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


@pytest.mark.parametrize("kwargs, param, text", [
    (dict(previous_response_id="resp_nowhere"), "previous_response_id", "not found"),
    (dict(input=[{"type": "image", "url": "x"}]), "input[0].type", "function_call_output"),
    (dict(input=[]), "input", "non-empty"),
    (dict(background=True), "background", "not supported"),
    (dict(tools=[{"type": "web_search"}]), "tools[0].type", "function tools"),
    (dict(tools=[WEATHER, WEATHER]), "tools[1].name", "unique"),
    (dict(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "strnig"}}}),
     "text.format.schema", "cannot be enforced"),
    (dict(max_output_tokens=0), "max_output_tokens", "positive"),
    (dict(input=[{"type": "function_call_output", "call_id": "call_x", "output": "1"}]), "input[0].tool_call_id",
     "no earlier"),
])
def test_bad_requests_are_400s_naming_the_parameter(client, pie_server, kwargs, param, text):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{"model": MODEL, "input": "Hi", "max_output_tokens": 4, **kwargs})
    assert e.value.body["param"] == param and text in e.value.body["message"], e.value.body
    resources = pie_server.resources()
    assert resources["kv_pages_free"] == resources["kv_pages_total"]  # nothing launched, nothing held
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=2).output


def test_stored_responses_are_per_user_and_bounded():
    store = ResponseStore(per_user=2)
    for i in range(3):
        store.put("alice", f"resp_{i}", Stored({"id": f"resp_{i}"}, []))
    assert store.get("alice", "resp_0") is None and store.get("alice", "resp_2") is not None  # oldest went
    assert store.get("bob", "resp_2") is None and not store.delete("bob", "resp_2")
    with pytest.raises(ApiError, match="not found"):
        to_chat({"model": MODEL, "input": "x", "previous_response_id": "resp_2"}, store, "bob")
    spec = to_chat({"model": MODEL, "input": "x", "previous_response_id": "resp_2", "store": False}, store, "alice")
    assert spec.chat["messages"] == [{"role": "user", "content": "x"}] and not spec.store
