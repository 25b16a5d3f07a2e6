"""The scoring path (issue 18; PrefillOnly): passes that write no KV and return the
log-probabilities of given tokens — the `scoring` inferlet (`Context::score`) and
`/v1/completions` with `max_tokens: 1` and `logprobs` — through a real `pie serve` (fp32),
held to HF transformers' log-probabilities on the same tokens."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pie_server import TOKEN, build, run_inferlet

QUESTION = "\nQuestion: would this user like the post above? Answer Yes or No.\nAnswer:"
PROFILE = ("Maria is a retired schoolteacher from Lisbon who grows tomatoes, reads history books "
           "about the age of exploration and walks her two dogs along the river every morning.")
POSTS = ["A guide to growing heirloom tomatoes on a small balcony.",
         "The ten fastest sports cars of the year, ranked by top speed.",
         "How Portuguese navigators mapped the coast of Africa in the fifteenth century."]


def hf_logprobs(hf_model, ids: list[int], candidates: list[int]) -> list[float]:
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0, -1].float()
    return torch.log_softmax(logits, -1)[candidates].tolist()


def test_mlp_chunks_give_the_same_scores(model_dir):
    """`backend.mlp_chunk_tokens`: a 300-token scoring pass (no output pages: no KV kept)
    whose MLPs run 75 tokens at a time returns the unchunked top-k exactly and the same
    log-probabilities to fp32 rounding (measured: <= 8e-6 apart; the matmul library sums a
    300-row product in another order than 75-row ones; 64- and 100-token chunks agree bit
    for bit)."""
    from array import array

    from pie.backend.engine import Engine
    from pie.config import BackendConfig
    from pie.control.passes import Output, Pass, encode

    tokens = [(7 * i + 300) % 49_000 for i in range(300)]
    replies = []
    for chunk in (0, 64):
        engine = Engine(model_dir, BackendConfig(dtype="float32", num_kv_pages=8, num_embeds=8, mlp_chunk_tokens=chunk))
        score = Pass(None, 0, 16, tokens, list(range(300)), [], [], 0, [], 0, None,  # type: ignore[arg-type]
                     [Output(299, logprob_ids=[5, 42, 1000], dist_k=4), Output(150, logprob_ids=[7])])
        reply = engine.handle(encode([score]))
        assert reply.errors == {}
        replies.append(reply)
    unchunked, chunked = replies
    assert chunked.dist_ids == unchunked.dist_ids and chunked.tokens == unchunked.tokens

    def floats(data: bytes) -> list[float]:
        values = array("f")
        values.frombytes(data)
        return values.tolist()

    assert len(floats(chunked.logprobs)) == 4 and all(v < 0 for v in floats(chunked.logprobs))
    assert floats(chunked.logprobs) == pytest.approx(floats(unchunked.logprobs), abs=5e-5, rel=0)
    assert floats(chunked.dist_probs) == pytest.approx(floats(unchunked.dist_probs), abs=1e-6, rel=0)


def test_scoring_inferlet_scores_every_post_as_hf_and_keeps_no_kv_for_them(pie_server, hf_model, tokenizer):
    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    run = run_inferlet(pie_server, build("scoring"), ["--profile", PROFILE, "--posts", "\n".join(POSTS)])
    assert run.reason == "finished", run.messages
    out = json.loads(run.messages[0])
    candidates = [ids(" Yes")[0], ids(" No")[0]]
    profile = ids(f"User profile:\n{PROFILE}\n")
    assert out["posts"] == 3 and out["tokens"] == len(profile) + sum(len(ids(f"Post: {p}{QUESTION}")) for p in POSTS)
    for post, got, p_yes in zip(POSTS, out["logprobs"], out["p_yes"]):
        expected = hf_logprobs(hf_model, profile + ids(f"Post: {post}{QUESTION}"), candidates)
        assert got == pytest.approx(expected, abs=2e-3)
        assert p_yes == pytest.approx(math.exp(got[0]) / (math.exp(got[0]) + math.exp(got[1])), abs=1e-5)
    # Only the profile's pages were ever held: the posts' keys and values lived in the pass.
    assert run.usage["kv_pages_peak"] == math.ceil((len(profile) - 1) / 16)


def test_scoring_bad_input_is_refused_precisely(pie_server):
    program = build("scoring")
    run = run_inferlet(pie_server, program, ["--profile", PROFILE, "--posts", "\n\n"])
    assert run.reason.endswith("--posts holds no post; usage: --profile TEXT --posts TEXT(newline-separated) "
                               "[--question TEXT] [--hint]")
    run = run_inferlet(pie_server, program, ["--posts", "x"])
    assert "--profile is required" in run.reason


def test_a_one_token_completion_with_logprobs_is_one_pass_that_writes_no_kv(pie_server, hf_model, tokenizer):
    import openai

    client = openai.OpenAI(base_url=f"http://{pie_server.address}/v1", api_key=TOKEN, max_retries=0)
    prompt = f"User profile:\n{PROFILE}\nPost: {POSTS[0]}{QUESTION}"
    before = pie_server.scheduler()["calls"]
    r = client.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=1,
                                  temperature=0, logprobs=3)
    after = pie_server.scheduler()["calls"]
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    with torch.inference_mode():
        logp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, -1].float(), -1)
    top = torch.topk(logp, 3)
    lp = r.choices[0].logprobs
    assert lp.tokens[0] == tokenizer.decode([int(top.indices[0])])
    assert lp.token_logprobs[0] == pytest.approx(float(top.values[0]), abs=1e-3)
    assert list(lp.top_logprobs[0].values()) == pytest.approx(top.values.tolist(), abs=1e-3)
    # One fused pass; none of the three-call path (forward, get-next-dist, sample).
    assert after.get("pass", 0) - before.get("pass", 0) == 1
    assert all(after.get(k, 0) == before.get(k, 0) for k in ("forward", "sample", "next_dist"))
