"""Beam search in Python, the twin of inferlets/beam_search (Rust), with the SDK's
`inferlet.beam_search` (the twin of Rust's `inferlet::beam::beam_search`).

Keeps the `--beams` most likely continuations by total log-probability. Every beam is a fork
of the prompt's context, so all beams share the prompt's KV pages (copy-on-write); each step
asks for every beam's top next tokens at once, so the calls batch together.

Arguments: --prompt TEXT [--beams B] [--max-tokens N]
Output: one JSON object {"text", "tokens", "logprob"} for the best beam (its tokens end
with the EOS token if it ended on one; the text does not).
"""

import json

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
    eos = root.queue.eos_tokens()
    tokens, logprob = inferlet.beam_search(root, width, max_tokens, eos)[0]
    text = root.queue.detokenize([t for t in tokens if t not in eos])
    inferlet.send(json.dumps({"text": text, "tokens": tokens, "logprob": logprob}))
