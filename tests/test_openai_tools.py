"""Tool calling on `/v1/chat/completions` (issue 20, item 2): unit tests of the request
checks, the prompt rendering and the streaming parser; then, through a real `pie serve`
(fp32) with the official `openai` client, a tool round trip (call, tool result, answer),
the same call streamed, and bad tool requests. The oracle: HF transformers' greedy decoding
under llguidance's mask for the same grammar, on the same rendered prompt."""

from __future__ import annotations

import json

import llguidance
import openai
import pytest

from pie.control.chat_template import render_chat
from pie.server.openai_tools import (ToolCallParser, ToolError, Tools, call_text, parse_tools,
                                     render_messages)
from pie_server import TOKEN

MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                                                        "required": ["city"], "additionalProperties": False}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


# --- without a server ----------------------------------------------------------------------


def test_the_grammar_holds_calls_to_the_tools_schemas(model_dir):
    tokenizer = llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), n_vocab=49152, eos_token=[2])

    def accepts(tools: Tools, text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, llguidance.grammar_from("lark", tools.grammar()))
        return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()

    auto = parse_tools({"tools": [WEATHER, TIME]})
    paris = call_text("get_weather", {"city": "Paris", "unit": "celsius"})
    assert accepts(auto, paris) and accepts(auto, paris + "\n" + call_text("get_time", {"city": "Oslo"}))
    assert accepts(auto, "It is sunny.")  # auto: text or calls
    assert not accepts(auto, call_text("get_weather", {"city": "Paris"}))  # unit is required
    assert not accepts(auto, call_text("get_news", {}))  # no such tool
    required = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False})
    assert not accepts(required, "It is sunny.") and accepts(required, paris)
    assert not accepts(required, paris + "\n" + paris)  # one call only
    named = parse_tools({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert accepts(named, call_text("get_time", {"city": "Oslo"})) and not accepts(named, paris)


def test_a_stream_parses_the_same_in_any_pieces():
    tools = parse_tools({"tools": [WEATHER, TIME]})
    text = call_text("get_weather", {"city": "Pa}ris", "unit": "celsius"}) + "\n" + call_text("get_time", {"city": "X"})
    whole = ToolCallParser(tools)
    whole.feed(text)
    whole.finish()
    pieces = ToolCallParser(tools)
    deltas = [d for ch in text for d in pieces.feed(ch)] + pieces.finish()
    assert [c["function"] for c in whole.message()["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Pa}ris", "unit": "celsius"}'},
        {"name": "get_time", "arguments": '{"city": "X"}'}]
    assert [c["function"] for c in pieces.message()["tool_calls"]] == [c["function"] for c in whole.calls]
    heads = [d["tool_calls"][0] for d in deltas if "id" in d["tool_calls"][0]]
    assert [h["index"] for h in heads] == [0, 1] and heads[0]["function"] == {"name": "get_weather", "arguments": ""}
    streamed = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas if d["tool_calls"][0]["index"] == 0)
    assert streamed == '{"city": "Pa}ris", "unit": "celsius"}'
    assert pieces.finish_reason("stop") == "tool_calls" and pieces.finish_reason("length") == "length"
    text_only = ToolCallParser(tools)
    assert text_only.feed("<tool") == [] and text_only.finish() == [{"content": "<tool"}]  # text after all
    assert text_only.message() == {"role": "assistant", "content": "<tool"} and text_only.finish_reason("stop") == "stop"


def test_a_conversation_with_calls_renders_for_the_template():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    messages = [{"role": "system", "content": "Be brief."}, *QUESTION,
                {"role": "assistant", "content": None, "tool_calls": [call, {**call, "id": "call_2"}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
                {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}]
    turns = render_messages(messages, parse_tools({"tools": [WEATHER]}))
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user"]
    assert turns[0]["content"].startswith("Be brief.\n\nYou may call") and '"name": "get_weather"' in turns[0]["content"]
    assert turns[2]["content"] == "\n".join([call_text("get_weather", {"city": "Paris"})] * 2)
    assert turns[3]["content"] == "<tool_response>\n18 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"
    assert render_messages(QUESTION, None) == QUESTION  # no tools: the conversation as it was
    with pytest.raises(ToolError, match="no earlier") as e:
        render_messages([*QUESTION, {"role": "tool", "tool_call_id": "call_9", "content": "x"}], None)
    assert e.value.param == "messages[1].tool_call_id"
    with pytest.raises(ToolError, match="already answered"):
        render_messages(messages + [{"role": "tool", "tool_call_id": "call_1", "content": "x"}], None)


@pytest.mark.parametrize("body, param, text", [
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "unique"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_news"}}}, "tool_choice",
     "not in tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", '"required"'),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]", "function tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "1-64"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters",
     "schema object"),
    ({"tools": WEATHER}, "tools", "array"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
])
def test_bad_tools_name_the_parameter(body, param, text):
    with pytest.raises(ToolError, match=text) as e:
        parse_tools(body)
    assert e.value.param == param


# --- through a real server -----------------------------------------------------------------


@pytest.fixture(scope="module")
def client(pie_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{pie_server.address}/v1", api_key=TOKEN, max_retries=0)


def test_a_tool_round_trip_is_hf_greedy_under_the_grammar(client, chat_template, tokenizer, grammar_greedy):
    """Call (tool_choice required, one call), tool result, final answer (auto): each turn's
    output is HF's greedy output under the same grammar on the same rendered prompt."""
    tools = [WEATHER, TIME]

    def oracle(messages: list, body: dict, max_tokens: int) -> str:
        spec = parse_tools({"tools": tools, **body})
        prompt = render_chat(chat_template, render_messages(messages, spec), True)
        return grammar_greedy(tokenizer.encode(prompt, add_special_tokens=False).ids, "lark", spec.grammar(), max_tokens)

    body = {"tool_choice": "required", "parallel_tool_calls": False}
    first = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=tools, max_tokens=40,
                                           temperature=0, **body)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.type == "function" and call.id.startswith("call_") and set(arguments) == {"city", "unit"}
    assert call_text(call.function.name, arguments) == oracle(QUESTION, body, 40)
    history = [*QUESTION, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=tools, max_tokens=24, temperature=0)
    text = answer.choices[0].message.content
    assert answer.choices[0].message.tool_calls is None and text
    assert text == oracle(history, {}, 24)


def test_a_streamed_call_arrives_as_tool_call_deltas(client, pie_server):
    named = {"type": "function", "function": {"name": "get_time"}}
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], tool_choice=named,
                                           max_tokens=40, temperature=0)
    chunks = [c for c in client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER, TIME],
                                                        tool_choice=named, max_tokens=40, temperature=0, stream=True)]
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0].role == "assistant" and not any(d.content for d in deltas)
    heads = [t for d in deltas for t in d.tool_calls or [] if t.id]
    assert [(h.index, h.function.name) for h in heads] == [(0, "get_time")]
    arguments = "".join(t.function.arguments or "" for d in deltas for t in d.tool_calls or [])
    (call,) = whole.choices[0].message.tool_calls
    assert arguments == call.function.arguments and json.loads(arguments)["city"]
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "tool_calls"
    # the round trip streamed, as the SDK's stream helper assembles it
    with client.chat.completions.stream(model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], tool_choice=named,
                                        max_tokens=40, temperature=0) as stream:
        called = stream.get_final_completion().choices[0]
    assert called.finish_reason == "tool_calls" and called.message.tool_calls[0].function.arguments == arguments
    history = [*QUESTION, called.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": called.message.tool_calls[0].id, "content": "14:05"}]
    final = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, TIME], max_tokens=64,
                                           temperature=0)
    with client.chat.completions.stream(model=MODEL, messages=history, tools=[WEATHER, TIME], max_tokens=64,
                                        temperature=0) as stream:
        answer = stream.get_final_completion().choices[0]
    assert answer.message.content == final.choices[0].message.content and answer.message.content
    assert answer.finish_reason == final.choices[0].finish_reason
    resources = pie_server.resources()
    assert resources["kv_pages_free"] == resources["kv_pages_total"]


@pytest.mark.parametrize("kwargs, param, text", [
    (dict(tools=[WEATHER, WEATHER]), "tools[1].function.name", "unique"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_news"}}), "tool_choice",
     "not in tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}]),
     "tools[0].function.parameters", "cannot be enforced"),
    (dict(messages=[*QUESTION, {"role": "tool", "tool_call_id": "call_x", "content": "18 C"}]),
     "messages[1].tool_call_id", "no earlier"),
    (dict(tools=[WEATHER], response_format={"type": "json_object"}), "response_format", "cannot be combined"),
])
def test_bad_tool_requests_are_400s_and_the_server_keeps_serving(client, pie_server, kwargs, param, text):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": MODEL, "messages": QUESTION, "max_tokens": 4, **kwargs})
    assert e.value.body["param"] == param and text in e.value.body["message"], e.value.body
    resources = pie_server.resources()
    assert resources["kv_pages_free"] == resources["kv_pages_total"]  # nothing launched, nothing held
    assert client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2).choices
