"""Grammar-constrained decoding: the control layer's llguidance matcher, the backend's token
mask, and the `constrained_decoding` inferlet through a real server."""

from __future__ import annotations

import json
import re

import pytest

from pie import protocol as P
from pie.control.errors import HostError
from pie.control.grammar import GrammarCompiler
from pie_server import build, run_inferlet

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
ARITHMETIC = 'root ::= expr\nexpr ::= num (" " op " " num)+\nop ::= "+" | "-" | "*"\nnum ::= [1-9] [0-9]?\n'
ARITHMETIC_RE = r"[1-9][0-9]?( [+\-*] [1-9][0-9]?)+"


@pytest.fixture(scope="module")
def compiler(model_dir) -> GrammarCompiler:
    hs = P.HandshakeReply(protocol_version=1, model_name="m", traits=[], page_size=16, num_kv_pages=1,
                          num_embeds=1, vocab_size=49152, hidden_size=1, max_batch_tokens=1,
                          tokenizer_json=(model_dir / "tokenizer.json").read_text(), eos_token_ids=[2],
                          bos_token_id=1, chat_template="", dtype="float32", device="cpu")
    return GrammarCompiler(hs)


def test_matcher_allows_only_grammatical_tokens(compiler, tokenizer):
    m = compiler.compile("regex", r"(yes|no)\.")
    allowed = {tokenizer.id_to_token(t) for t in m.allowed_tokens()}
    assert "yes" in allowed and "no" in allowed and "maybe" not in allowed
    with pytest.raises(HostError, match="not allowed"):
        m.accept(tokenizer.encode("maybe", add_special_tokens=False).ids)
    m.accept(tokenizer.encode("no", add_special_tokens=False).ids)
    assert not m.is_accepting()
    m.accept(tokenizer.encode(".", add_special_tokens=False).ids)
    assert m.is_accepting() and m.is_stopped()
    m.rollback(1)
    assert not m.is_accepting()
    assert len(m.allowed_mask()) == 49152 // 8


def test_bad_grammars_are_invalid_arguments(compiler):
    for kind, source in [("json-schema", "{not json"), ("ebnf", "root ::= ("), ("regex", "(")]:
        with pytest.raises(HostError) as e:
            compiler.compile(kind, source)
        assert e.value.kind == "invalid-argument" and kind in e.value.message


@pytest.fixture(scope="module")
def program() -> bytes:
    return build("constrained_decoding")


def constrained(server, program, prompt: str, *grammar: str, max_tokens: int = 48):
    return run_inferlet(server, program, ["--prompt", prompt, *grammar, "--max-tokens", str(max_tokens)])


def test_json_schema_output_validates(pie_server, program):
    run = constrained(pie_server, program, "Describe a person as JSON.", "--json-schema", json.dumps(PERSON))
    assert run.reason == "finished", run
    person = json.loads(run.messages[0])
    assert set(person) == {"name", "age"}
    assert isinstance(person["name"], str) and len(person["name"]) <= 20
    assert isinstance(person["age"], int) and 0 <= person["age"] <= 150


def test_ebnf_output_parses(pie_server, program):
    run = constrained(pie_server, program, "Write a sum of small numbers.", "--ebnf", ARITHMETIC)
    assert run.reason == "finished", run
    assert re.fullmatch(ARITHMETIC_RE, run.messages[0]), run.messages


def test_regex_output_matches_and_sampling_stays_inside(pie_server, program):
    pattern = r"\(\d{3}\) \d{3}-\d{4}"
    outputs = set()
    for seed in (1, 2):
        run = run_inferlet(pie_server, program, ["--prompt", "Give me a phone number.", "--regex", pattern,
                                                 "--temperature", "1.5", "--seed", str(seed)])
        assert run.reason == "finished", run
        assert re.fullmatch(pattern, run.messages[0]), run.messages
        outputs.add(run.messages[0])
    assert len(outputs) == 2  # sampled, yet every draw stayed inside the language
    resources = pie_server.resources_once_pages_free()


def test_a_bad_grammar_fails_the_instance_with_the_reason(pie_server, program):
    run = constrained(pie_server, program, "x", "--ebnf", "root ::= (")
    assert run.reason.startswith("error: invalid-argument: ebnf grammar"), run.reason
