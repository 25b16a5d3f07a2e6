"""Speculative decoding in Python, the twin of inferlets/speculative_decoding (Rust), with the
SDK's `inferlet.speculative` (the twin of Rust's `inferlet::speculative`): prompt-lookup
drafts verified in one pass each; the output is exactly greedy decoding.

Arguments: --prompt TEXT [--max-tokens N (64)] [--ngram N (3)]
Output: one JSON object {"text", "tokens", "steps", "drafted", "accepted"}.
"""

import argparse
import json

import inferlet
from inferlet.speculative import NgramDrafter, generate_speculative


def main(args: list[str]) -> None:
    parser = argparse.ArgumentParser(description="Greedy generation sped up by prompt-lookup drafts.")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ngram", type=int, default=3)
    o = parser.parse_args()
    ctx = inferlet.Model.default().create_context()
    ctx.fill_chat([inferlet.chat("user", o.prompt)])
    out = generate_speculative(ctx, NgramDrafter(max(1, o.ngram)), inferlet.Stop(o.max_tokens, eos=ctx.queue.eos_tokens()))
    inferlet.send(json.dumps({"text": out.text, "tokens": len(out.tokens), "steps": out.steps,
                              "drafted": out.drafted, "accepted": out.accepted}))
