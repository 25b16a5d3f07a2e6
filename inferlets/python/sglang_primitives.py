"""SGLang's primitives in an inferlet: `select` among choices, `gen` with a regex, a stop
string or choices, named results, and JSON-schema output, on one context.

A multiple-choice question answered the SGLang way: the choice is *scored* (`select`, every
choice in one batch of passes that write no KV, normalised as asked); the prompt is
prefilled once and forked per choice to see how the model would go on after each
(`generate_branches`, SGLang's `fork`: the branches decode together); then the model gives
a one-line reason (`gen` until a newline), a confidence from 0 to 100 (`gen` with a regex),
and a JSON verdict whose shape a schema fixes (`generate` with `Grammar.json_schema`). Each
`gen` continues the same context, so nothing before it is computed twice.

Arguments: --question TEXT --choice TEXT [--choice TEXT ...]
           [--normalize sum|mean|unconditional] [--max-tokens N]
Output: one JSON object: {"answer", "scores", "logprobs", "continuations", "reason",
"confidence", "verdict"}, the named results.
"""

import argparse
import json

import inferlet

VERDICT = {"type": "object", "properties": {"sure": {"type": "boolean"}}, "required": ["sure"],
           "additionalProperties": False}


def main(args: list[str]) -> None:
    parser = argparse.ArgumentParser(description="Answer a multiple-choice question with SGLang's primitives.")
    parser.add_argument("--question", required=True)
    parser.add_argument("--choice", action="append", required=True, help="a possible answer (repeat)")
    parser.add_argument("--normalize", choices=["sum", "mean", "unconditional"], default="mean")
    parser.add_argument("--max-tokens", type=int, default=24)
    o = parser.parse_args()

    ctx = inferlet.Model.default().create_context()
    ctx.fill_chat([inferlet.chat("user", f"{o.question}\nAnswer with one of: {', '.join(o.choice)}.")])
    results = {}
    picked = ctx.select(o.choice, normalize=o.normalize)
    results.update(answer=picked.text, scores=picked.scores, logprobs=picked.logprobs)
    ctx.flush()  # the prompt's KV, read in place by every branch
    after_each = inferlet.generate_branches(ctx, [ctx.queue.tokenize(c) for c in o.choice], [inferlet.Sampler.greedy()],
                                            inferlet.Stop(o.max_tokens, eos=ctx.queue.eos_tokens(), strings=["\n"]))
    results["continuations"] = {choice: branch.text for choice, branch in zip(o.choice, after_each)}
    ctx.fill(picked.text + "\nReason:")
    results["reason"] = ctx.gen(o.max_tokens, stop=["\n"]).strip()
    ctx.fill("\nConfidence (0-100): ")
    results["confidence"] = int(ctx.gen(4, regex=r"[0-9]{1,2}|100"))
    ctx.fill("\nVerdict as JSON: ")
    grammar = inferlet.Grammar.json_schema(ctx.queue, VERDICT)
    stop = inferlet.Stop(o.max_tokens, eos=ctx.queue.eos_tokens())
    results["verdict"] = json.loads(ctx.generate(inferlet.Sampler.greedy(), stop, grammar))
    inferlet.send(json.dumps(results))
