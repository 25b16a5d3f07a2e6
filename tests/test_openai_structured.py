"""Structured outputs on the OpenAI endpoints (issue 20, item 1), through a real `pie serve`
(fp32) with the official `openai` client, as a new user would call them: `response_format`
`json_schema` (a pydantic model through `chat.completions.parse`) and `json_object`, whole
and streamed, on chat and completions. The oracle: HF transformers' greedy decoding with
llguidance's mask for the same schema applied to every step's logits."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from openai.lib._pydantic import to_strict_json_schema

from pie.control.chat_template import chat_prompt
from pie.server.openai import response_schema
from pie_server import TOKEN

MODEL = "smollm2-135m-instruct"


class City(BaseModel):
    name: str = Field(max_length=20)
    country: Literal["France", "Germany", "Italy", "Spain"]
    is_capital: bool


ANSWER = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(pie_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{pie_server.address}/v1", api_key=TOKEN, max_retries=0)


@pytest.fixture(scope="module")
def constrained_greedy(grammar_greedy):
    """HF greedy under llguidance's mask for `response_format` `fmt`: the text."""
    def run(prompt_ids: list[int], fmt: dict, max_tokens: int) -> str:
        return grammar_greedy(prompt_ids, "json_schema", response_schema(fmt), max_tokens)  # as the endpoint sends it

    return run


def test_parse_with_a_pydantic_model_is_hf_greedy_under_the_schema(client, chat_template, tokenizer,
                                                                   constrained_greedy):
    question = "Name a famous European city."
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": question}],
                                      response_format=City, max_tokens=48, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, City)
    fmt = {"type": "json_schema", "json_schema": {"name": "City", "schema": to_strict_json_schema(City), "strict": True}}
    prompt = tokenizer.encode(chat_prompt(chat_template, question), add_special_tokens=False).ids
    assert choice.message.content == constrained_greedy(prompt, fmt, 48)


def test_a_schema_on_completions_and_json_object_on_chat(client, tokenizer, constrained_greedy):
    prompt = "Q: How many legs does a spider have?\nA (JSON):"
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"response_format": fmt})  # not in the SDK's completions signature
    assert r.choices[0].finish_reason == "stop"
    assert 0 <= json.loads(r.choices[0].text)["answer"] <= 99
    assert r.choices[0].text == constrained_greedy(tokenizer.encode(prompt, add_special_tokens=False).ids, fmt, 24)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a cat as a JSON object with two keys."}],
        max_tokens=96, temperature=0, response_format={"type": "json_object"})
    assert chat.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(chat.choices[0].message.content), dict)


def test_streamed_sampled_and_with_logprobs_stay_valid(client):
    """Streaming gives the whole response's text in deltas; sampled choices (n = 3) and the
    log-probability path (the guest masks each draw itself) are held to the schema too."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    messages = [{"role": "user", "content": "How many days are in a week? Answer in JSON."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                           response_format=fmt)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                 response_format=fmt, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    sampled = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=1.0,
                                             seed=7, n=3, response_format=fmt)
    probed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                            logprobs=True, top_logprobs=2, response_format=fmt)
    assert probed.choices[0].message.content == whole.choices[0].message.content
    assert len(probed.choices[0].logprobs.content) == probed.usage.completion_tokens
    for choice in [*sampled.choices, *probed.choices]:
        assert choice.finish_reason == "stop" and 0 <= json.loads(choice.message.content)["answer"] <= 99


@pytest.mark.parametrize("fmt, param, text", [
    ({"type": "xml"}, "response_format.type", "text, json_object or json_schema"),
    ("json", "response_format", "must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": ANSWER}}, "response_format.json_schema.name", "1-64"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": ANSWER}}, "response_format.json_schema.name",
     "1-64"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": ANSWER, "strict": "yes"}},
     "response_format.json_schema.strict", "boolean"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "response_format.json_schema.schema",
     "JSON schema object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}},
     "response_format.json_schema.schema", "cannot be enforced"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/nowhere"}}},
     "response_format.json_schema.schema", "cannot be enforced"),
])
def test_bad_response_formats_are_400s_naming_the_parameter(client, pie_server, fmt, param, text):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       response_format=fmt)
    error = e.value.body
    assert error["param"] == param and text in error["message"], error
    resources = pie_server.resources()
    assert resources["kv_pages_free"] == resources["kv_pages_total"]  # nothing launched, nothing held


def test_ignore_eos_with_a_schema_is_refused(client):
    with pytest.raises(openai.BadRequestError, match="ignore_eos"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                  extra_body={"ignore_eos": True, "response_format": {"type": "json_object"}})
