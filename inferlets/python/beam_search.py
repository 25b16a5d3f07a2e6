"""Beam search in Python, the twin of inferlets/beam_search (Rust).

Keeps the `--beams` most likely continuations by total log-probability. Every beam is a fork
of the prompt's context, so all beams share the prompt's KV pages (copy-on-write); each step
asks for every beam's top next tokens at once, so the calls batch together.

Arguments: --prompt TEXT [--beams B] [--max-tokens N]
Output: one JSON object {"text", "tokens", "logprob"} for the best beam.
"""

import json
import math

import inferlet


def parse(args: list[str]) -> tuple[str, int, int]:
    options = {"--prompt": None, "--beams": "3", "--max-tokens": "16"}
    for flag, value in zip(args[::2], args[1::2]):
        if flag not in options:
            raise ValueError(f"unknown argument {flag!r}; usage: --prompt TEXT [--beams B] [--max-tokens N]")
        options[flag] = value
    if options["--prompt"] is None:
        raise ValueError("--prompt is required")
    return options["--prompt"], int(options["--beams"]), int(options["--max-tokens"])


def main(args: list[str]) -> None:
    prompt, width, max_tokens = parse(args)
    root = inferlet.Model.default().create_context()
    root.fill_chat([inferlet.chat("user", prompt)])
    root.flush()
    queue = root.queue
    eos = set(queue.eos_tokens())
    beams = [(0.0, root, [])]  # (log-probability, context, generated tokens)
    done = []
    for _ in range(max_tokens):
        embeds = [ctx.forward_pending([len(ctx.pending) - 1])[0] for _, ctx, _ in beams]
        dists = inferlet.wait_all([queue.next_dist(e, width) for e in embeds])
        candidates = sorted(((score + math.log(p), i, token)
                             for i, (score, _, _) in enumerate(beams)
                             for token, p in zip(*dists[i]) if p > 0), reverse=True)[:width]
        survivors = []
        for score, i, token in candidates:
            _, parent, tokens = beams[i]
            if token in eos:
                done.append((score, tokens))
                continue
            child = parent.fork()
            child.fill_tokens([token])
            survivors.append((score, child, tokens + [token]))
        beams = survivors
        if not beams:
            break
    best_score, best_tokens = max(done + [(score, tokens) for score, _, tokens in beams])
    inferlet.send(json.dumps({"text": queue.detokenize(best_tokens), "tokens": best_tokens,
                              "logprob": best_score}))
