"""Shared fixtures: the converted default model, an in-process engine, a real backend process."""

from __future__ import annotations

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


def hf_greedy(hf_model, prompt_ids: list[int], n: int) -> list[int]:
    """HF transformers' greedy decoding with its own KV cache, continuing past EOS."""
    tokens: list[int] = []
    with torch.inference_mode():
        out = hf_model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(n):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = hf_model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                           use_cache=True)
    return tokens


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
