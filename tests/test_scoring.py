"""The scoring path (issue 18; PrefillOnly): passes that write no KV and return the
log-probabilities of given tokens — the `scoring` inferlet (`Context::score`) and
`/v1/completions` with `max_tokens: 1` and `logprobs` — through a real `pie serve` (fp32),
held to HF transformers' log-probabilities on the same tokens."""

from __future__ import annotations

import json
import math

import numpy as np
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


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_chunked_items_give_the_one_shot_results(model_dir, dtype):
    """`backend.mlp_chunk_tokens` (chunked_forward.py): a 520-token prefix written to pages,
    then a 540-token scoring pass over it that keeps no KV; each run 256 tokens at a time.
    Outputs (top-k, drawn tokens) equal the one-shot forward's, log-probabilities and the
    prefix's pages to the last bits (bit for bit when the matmul library sums as it did in
    the one-shot forward: on an idle machine without AMX, always; under load it did not
    once). In bf16 on a CPU with AMX (Sapphire Rapids), oneDNN's kernels block a 256-row
    matmul differently from a 540-row one, and logits differ by about one bf16 step (0.125
    at magnitude 16-32): measured 0.003 in a probability of 0.047 and 0.14 in a
    log-probability of -23, so bf16 is held to two such steps.
    Beside a 4-token pass in one batch, each gives what it gives alone: bit for bit where the
    matmul library gives a row the same bits whatever rows are beside it (`_row_invariant_matmul`),
    within 1e-4 elsewhere (as chunked vs one-shot; measured 1.05e-5 on an AMD EPYC)."""
    from pie.backend.engine import Engine
    from pie.config import BackendConfig
    from pie.control.passes import Output, Pass, encode

    prefix = [(7 * i + 300) % 49_000 for i in range(520)]
    post = [(11 * i + 77) % 49_000 for i in range(540)]
    pages = list(range(33))  # 520 tokens: 32 full pages and 8 slots of the 33rd
    results = []
    for chunk in (0, 256):
        engine = Engine(model_dir, BackendConfig(dtype=dtype, num_kv_pages=40, num_embeds=8,
                                                 mlp_chunk_tokens=chunk))
        fill = Pass(None, 0, 16, prefix, list(range(520)), [], [], 0, pages, 0, None,  # type: ignore[arg-type]
                    [Output(519, dist_k=5)])
        score = Pass(None, 1, 16, post, list(range(520, 1060)), [], pages, 8, [], 0, None,  # type: ignore[arg-type]
                     [Output(539, logprob_ids=[5, 42, 1000], dist_k=4), Output(150, logprob_ids=[7]),
                      Output(10, sample=True)])
        short = Pass(None, 2, 16, post[:4], list(range(520, 524)), [], pages, 8, [], 0, None,  # type: ignore[arg-type]
                     [Output(3, logprob_ids=[5])])
        replies = [engine.handle(encode(batch)) for batch in ([fill], [score], [score, short], [short])]
        assert all(reply.errors == {} for reply in replies)
        keys = torch.stack([engine.kv.keys[layer][:33] for layer in (0, 29)])
        results.append((replies, keys))
    (replies0, keys0), (replies1, keys1) = results
    for one_shot, chunked in zip(replies0[:2], replies1[:2]):
        assert chunked.dist_ids == one_shot.dist_ids and chunked.tokens == one_shot.tokens
        for field in ("logprobs", "dist_probs"):
            got, want = (np.frombuffer(getattr(r, field), np.float32) for r in (chunked, one_shot))
            tolerance = dict(abs=1e-4, rel=0) if dtype == "float32" else dict(abs=1e-4, rel=0.14)
            if field == "logprobs" and dtype == "bfloat16":
                tolerance = dict(abs=0.25, rel=0)  # two bf16 steps of a logit (measured: 0.14 at -23)
            assert got == pytest.approx(want, **tolerance), field
    # bf16 with AMX: layer 0 within 5e-4, the last layer's keys within 0.17 (measured), the
    # differences grown through 29 layers of one-step logit-sized disagreements
    for layer, bf16_tolerance in ((0, 1e-3), (1, 0.25)):
        assert torch.allclose(keys1[layer].float(), keys0[layer].float(),
                              atol=bf16_tolerance if dtype == "bfloat16" else 1e-5, rtol=0), layer
    alone, mixed = replies1[1], replies1[2]
    if _row_invariant_matmul():
        assert mixed.logprobs[:16] == alone.logprobs[:16] and mixed.logprobs[16:] == replies1[3].logprobs
        assert mixed.dist_probs == alone.dist_probs
    else:  # the logits matmul of a batch's output rows sums a row differently with other rows beside it
        for got, want in ((mixed.logprobs, alone.logprobs[:16] + replies1[3].logprobs),
                          (mixed.dist_probs, alone.dist_probs)):
            assert np.frombuffer(got, np.float32) == pytest.approx(np.frombuffer(want, np.float32), abs=1e-4, rel=0)


def _row_invariant_matmul() -> bool:
    """Whether this machine's fp32 matmul gives a row the same bits with 3 or 4 rows in the
    product (the logits of a few output rows). MKL on the Xeons this test was written on:
    yes; on an AMD EPYC with AVX2 only: no, a row differs by up to 5e-5 in a logit."""
    generator = torch.Generator().manual_seed(0)
    w, x = torch.randn(49152, 576, generator=generator), torch.randn(4, 576, generator=generator)
    return torch.equal(torch.nn.functional.linear(x[:3], w), torch.nn.functional.linear(x, w)[:3])


def test_a_no_kv_item_that_finds_the_scratch_full_runs_alone(model_dir):
    """Chunking on (256), the scratch pages hold two chunks' worth (512 tokens): of three
    200-token scoring passes in one batch the third runs alone, keeping one layer's K/V at a
    time; all three score as with chunking off (to rounding: their output rows meet the
    last layer's matmuls in other groupings)."""
    from pie.backend.engine import Engine
    from pie.config import BackendConfig
    from pie.control.passes import Output, Pass, encode

    def item(i: int) -> Pass:
        tokens = [(13 * j + 101 * i) % 49_000 for j in range(200)]
        return Pass(None, i, 16, tokens, list(range(200)), [], [], 0, [], 0, None,  # type: ignore[arg-type]
                    [Output(199, logprob_ids=[5, 42])])

    scores = []
    for chunk in (0, 256):
        engine = Engine(model_dir, BackendConfig(dtype="float32", num_kv_pages=8, num_embeds=8,
                                                 mlp_chunk_tokens=chunk))
        if chunk:
            assert engine.scratch_tokens == 512 and len(engine.kv.keys[0]) == 8 + 512 // 16
            layout = engine.layout()
            alone = [layout.add(np.zeros(0, np.int64), 0, 200, np.zeros(0, np.int64), 0, None).alone
                     for _ in range(3)]
            assert alone == [False, False, True]
        reply = engine.handle(encode([item(i) for i in range(3)]))
        assert reply.errors == {}
        scores.append(np.frombuffer(reply.logprobs, np.float32))
    assert len(scores[1]) == 6 and scores[1] == pytest.approx(scores[0], abs=1e-4)


@pytest.mark.parametrize("own_pages", [False, True])
def test_scoring_inferlet_scores_every_post_as_hf_and_keeps_no_kv_for_them(pie_server, hf_model, tokenizer, own_pages):
    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    profile_text = ("In short: " if own_pages else "") + PROFILE  # a profile of its own: no earlier hits
    hits = pie_server.resources()["prefix_cache"]["hit_tokens"]
    run = run_inferlet(pie_server, build("scoring"), ["--profile", profile_text, "--posts", "\n".join(POSTS)]
                       + ["--own-pages"] * own_pages)
    assert run.reason == "finished", run.messages
    out = json.loads(run.messages[0])
    candidates = [ids(" Yes")[0], ids(" No")[0]]
    profile = ids(f"User profile:\n{profile_text}\n")
    assert out["posts"] == 3 and out["tokens"] == len(profile) + sum(len(ids(f"Post: {p}{QUESTION}")) for p in POSTS)
    for post, got, p_yes in zip(POSTS, out["logprobs"], out["p_yes"]):
        expected = hf_logprobs(hf_model, profile + ids(f"Post: {post}{QUESTION}"), candidates)
        assert got == pytest.approx(expected, abs=2e-3)
        assert p_yes == pytest.approx(math.exp(got[0]) / (math.exp(got[0]) + math.exp(got[1])), abs=1e-5)
    hits = pie_server.resources()["prefix_cache"]["hit_tokens"] - hits
    if own_pages:  # only the profile's pages were ever held: the posts' keys and values lived in the pass
        assert run.usage["kv_pages_peak"] == math.ceil((len(profile) - 1) / 16) and hits == 0
    else:  # none held: the first post's pass computed the profile's full pages into the cache, the others read them
        assert run.usage["kv_pages_peak"] == 0
        assert hits == 2 * (len(profile) // 16) * 16


def test_scoring_bad_input_is_refused_precisely(pie_server):
    program = build("scoring")
    run = run_inferlet(pie_server, program, ["--profile", PROFILE, "--posts", "\n\n"])
    assert run.reason.endswith("--posts holds no post; usage: --profile TEXT --posts TEXT(newline-separated) "
                               "[--question TEXT] [--hint] [--own-pages]")
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
