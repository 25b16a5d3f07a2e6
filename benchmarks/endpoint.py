"""One OpenAI-compatible completions endpoint, as the client-side application scripts see it.

Every system (Pie's `/v1`, vLLM, llama.cpp's llama-server, SGLang) is driven through this
one class, so the baselines' application logic is the same Python whatever serves it, as in
the paper's evaluation. Engine-specific request fields live here and nowhere else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Completion:
    text: str
    completion_tokens: int
    prompt_tokens: int
    seconds: float
    finish_reason: str
    logprobs: list[dict[str, float]] = field(default_factory=list)  # per token: top alternatives


@dataclass
class Endpoint:
    """`base_url` is the server root (the API is under `/v1`); `engine` picks the dialect."""

    base_url: str
    model: str
    engine: str  # "pie" | "vllm" | "llamacpp" | "sglang"
    api_key: str | None = None
    # No connection cap (httpx's default is 100): the Swarm agents have 128 requests in flight.
    # Idle connections expire after 1 s, before any server's keep-alive timeout (uvicorn: 5 s):
    # reusing one the server is closing at that moment fails with ReadError (seen in a run).
    http: httpx.AsyncClient = field(default_factory=lambda: httpx.AsyncClient(
        timeout=1800, limits=httpx.Limits(max_connections=None, max_keepalive_connections=None,
                                          keepalive_expiry=1.0)), repr=False)

    async def complete(self, prompt: str, max_tokens: int, *, stop: list[str] | None = None,
                       ignore_eos: bool = False, temperature: float = 0.0, seed: int | None = None,
                       logprobs: int | None = None, n: int = 1,
                       json_schema: dict[str, Any] | None = None, grammar: str | None = None,
                       beam_search: bool = False) -> list[Completion]:
        """`POST /v1/completions` on a raw prompt; one Completion per choice (`n`).

        `grammar` constrains the output to a GBNF grammar (`root ::= ...`); `beam_search` asks
        the engine's own beam search with `n` beams (vLLM only), the `n` best beams returned."""
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": temperature, "n": n}
        if stop:
            body["stop"] = stop
        if seed is not None:
            body["seed"] = seed
        if logprobs is not None:
            body["logprobs"] = logprobs
        if ignore_eos:
            body["ignore_eos"] = True  # vLLM/SGLang/llama.cpp/Pie extension: generate exactly max_tokens
        if json_schema is not None:
            body.update(self._json_schema_field(json_schema))
        if grammar is not None:
            body.update(self._grammar_field(grammar))
        if self.engine == "llamacpp":
            body["cache_prompt"] = True  # llama-server's prompt cache, stated rather than left to its default
        if beam_search:
            if self.engine != "vllm":
                raise ValueError(f"{self.engine}: its OpenAI API has no beam search")
            body["use_beam_search"] = True
        start = time.perf_counter()
        response = await self.http.post(f"{self.base_url}/v1/completions", json=body, headers=self._headers())
        seconds = time.perf_counter() - start
        if response.status_code != 200:
            raise RuntimeError(f"{self.engine}: HTTP {response.status_code}: {response.text[:500]}")
        data = response.json()
        usage = data.get("usage") or {}
        choices = sorted(data["choices"], key=lambda c: c.get("index", 0))
        out = []
        for choice in choices:
            lp = choice.get("logprobs") or {}
            # llama-server's usage counts the first choice only (it merges per-choice results)
            tokens = _count_tokens(lp, usage, 1 if self.engine == "llamacpp" else len(choices))
            out.append(Completion(choice["text"], tokens, usage.get("prompt_tokens", 0), seconds,
                                  choice.get("finish_reason") or "", _top_logprobs(lp)))
        return out

    def _json_schema_field(self, schema: dict[str, Any]) -> dict[str, Any]:
        if self.engine == "llamacpp":
            return {"json_schema": schema}
        if self.engine == "vllm":
            return {"structured_outputs": {"json": schema}, "guided_json": schema}
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}}

    def _grammar_field(self, grammar: str) -> dict[str, Any]:
        if self.engine == "llamacpp":
            return {"grammar": grammar}
        if self.engine == "vllm":
            return {"structured_outputs": {"grammar": grammar}}
        if self.engine == "sglang":
            return {"ebnf": grammar}
        raise ValueError(f"{self.engine}: its OpenAI API has no grammar-constrained output")

    async def ready(self) -> bool:
        try:
            response = await self.http.get(f"{self.base_url}/v1/models", timeout=5, headers=self._headers())
            return response.status_code == 200
        except httpx.HTTPError:
            return False

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def aclose(self) -> None:
        await self.http.aclose()


def _top_logprobs(logprobs: dict[str, Any]) -> list[dict[str, float]]:
    if "content" in logprobs:  # llama-server answers /v1/completions in the chat shape
        return [{t["token"]: t["logprob"] for t in token["top_logprobs"]} for token in logprobs["content"] or []]
    return logprobs.get("top_logprobs") or []


def _count_tokens(logprobs: dict[str, Any], usage: dict[str, Any], choices: int) -> int:
    if logprobs.get("tokens"):
        return len(logprobs["tokens"])
    if logprobs.get("content"):
        return len(logprobs["content"])
    return usage.get("completion_tokens", 0) // max(choices, 1)
