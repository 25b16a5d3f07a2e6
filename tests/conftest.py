"""Shared fixtures: the converted default model, an in-process engine, a real backend process;
and the HF transformers oracle (fp32 greedy) that Pie's outputs are held to."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from pie.backend.weights import default_model_dir, pull_default_model
from pie.config import PieConfig

HF_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The default model, converted on first use exactly as `pie model pull` does."""
    cache = PieConfig().paths.cache
    if not default_model_dir(cache).is_dir():
        pull_default_model(cache, Console(stderr=True))
    return default_model_dir(cache)


@pytest.fixture(scope="session")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def hf_greedy(hf_model, prompt_ids: list[int], n: int, stop_at: int | None = None) -> list[int]:
    """HF transformers' greedy decoding with its own KV cache: `n` tokens, continuing past
    EOS unless `stop_at` (a token id) is given, where it stops (that token not included)."""
    tokens: list[int] = []
    with torch.inference_mode():
        out = hf_model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(n):
            token = int(out.logits[0, -1].argmax())
            if token == stop_at:
                break
            tokens.append(token)
            if len(tokens) < n:
                out = hf_model(torch.tensor([[token]]), past_key_values=out.past_key_values,
                               use_cache=True)
    return tokens


@pytest.fixture(scope="session")
def grammar_greedy(hf_model, tokenizer, model_dir):
    """HF greedy with llguidance's mask for a grammar applied to every step's logits, until
    EOS or `max_tokens`: the text. `kind` is llguidance's name (json_schema, lark, regex)."""
    import llguidance

    ll_tokenizer = llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(),
                                          n_vocab=hf_model.config.vocab_size, eos_token=[hf_model.config.eos_token_id])

    def run(prompt_ids: list[int], kind: str, source: str, max_tokens: int) -> str:
        matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.grammar_from(kind, source))
        out: list[int] = []
        with torch.inference_mode():
            step = hf_model(torch.tensor([prompt_ids]), use_cache=True)  # then one token a step, on its cache
            for _ in range(max_tokens):
                logits = step.logits[0, -1]
                bits = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
                allowed = ((bits[:, None] >> torch.arange(8)) & 1).flatten()[: logits.shape[0]].bool()
                token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
                if token == hf_model.config.eos_token_id:
                    break
                assert matcher.consume_tokens([token])
                out.append(token)
                step = hf_model(torch.tensor([[token]]), past_key_values=step.past_key_values, use_cache=True)
        return tokenizer.decode(out, skip_special_tokens=False)

    return run


@pytest.fixture(scope="session")
def chat_template(model_dir) -> str:
    return json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]


class HfChat:
    """hf_chat(prompt, max_tokens, system=None): what the built-in `text_completion` must
    answer, greedy, from the oracle — HF transformers fp32 greedy on the chat-template
    prompt (the user turn, after the system turn if given), up to EOS or max_tokens,
    decoded with special tokens kept. `tokens(...)`: the token ids (EOS excluded)."""

    def __init__(self, hf_model, tokenizer, template: str):
        self.hf_model, self.tokenizer, self.template = hf_model, tokenizer, template
        self.eos = hf_model.config.eos_token_id
        assert isinstance(self.eos, int), self.eos
        self.memo: dict[tuple, list[int]] = {}

    def tokens(self, prompt: str, max_tokens: int, system: str | None = None) -> list[int]:
        from pie.control.chat_template import chat_prompt

        key = (prompt, max_tokens, system)
        if key not in self.memo:
            ids = self.tokenizer.encode(chat_prompt(self.template, prompt, system), add_special_tokens=False).ids
            self.memo[key] = hf_greedy(self.hf_model, ids, max_tokens, stop_at=self.eos)
        return self.memo[key]

    def __call__(self, prompt: str, max_tokens: int, system: str | None = None) -> str:
        return self.tokenizer.decode(self.tokens(prompt, max_tokens, system), skip_special_tokens=False)


@pytest.fixture(scope="session")
def hf_chat(hf_model, tokenizer, chat_template) -> HfChat:
    return HfChat(hf_model, tokenizer, chat_template)


def sampling_pass(tokens: list[int], length: int, pages: list[int], page_size: int):
    """A fused pass appending `tokens` to a sequence of `length` cached tokens on `pages`
    and sampling greedily after its last token (engine-level tests drive `Engine.handle`)."""
    from pie.control.passes import Output, Pass

    ctx = pages[: -(-length // page_size)]
    last = length - (len(ctx) - 1) * page_size if ctx else 0
    return Pass(None, 0, page_size, list(tokens), list(range(length, length + len(tokens))), [],  # type: ignore[arg-type]
                ctx, last, pages[length // page_size:], length % page_size, None,
                [Output(len(tokens) - 1, sample=True)])


def run_sampling_passes(engine, items: list) -> list[int]:
    """One batch of `sampling_pass` items through the engine: the token each drew."""
    from array import array

    from pie.control.passes import encode

    reply = engine.handle(encode(items))
    assert reply.errors == {}
    tokens = array("i")
    tokens.frombytes(reply.tokens)
    return tokens.tolist()


def hf_probe_continuation(hf_model, tokenizer, prompt: str, page_size: int = 16) -> str:
    """What the probe inferlet's `export`/`import` modes send: the prompt's whole pages
    (leaving at least one token) are cached, the next token is fed, and 8 tokens are
    decoded greedily (EOS not special) — here by HF transformers on the same tokens."""
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    cached = (len(ids) - 1) // page_size * page_size
    return tokenizer.decode(hf_greedy(hf_model, ids[:cached + 1], 8), skip_special_tokens=False)


@pytest.fixture(scope="session")
def pie_server(tmp_path_factory, model_dir):
    """One real `pie serve` (fp32, auth token) shared by the end-to-end tests."""
    from pie_server import Server

    server = Server(tmp_path_factory.mktemp("pie-serve"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tool_server():
    """The local tool server (calculator, search, slow API, sandboxed execute)."""
    from pie_server import ToolServer

    server = ToolServer()
    yield server
    server.stop()
