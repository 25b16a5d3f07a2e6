"""`text_completion` in Python: one chat-template completion, sent as one message.

The twin of inferlets/text_completion (Rust), with the same arguments:
`--prompt TEXT --max-tokens N [--system TEXT] [--temperature T] [--top-p P] [--seed S]`.
"""

import inferlet

USAGE = "usage: --prompt TEXT --max-tokens N [--system TEXT] [--temperature T] [--top-p P] [--seed S]"


def parse(args: list[str]) -> dict:
    options = {"system": None, "temperature": None, "top_p": None, "seed": None}
    names = {"--prompt": ("prompt", str), "--max-tokens": ("max_tokens", int), "--system": ("system", str),
             "--temperature": ("temperature", float), "--top-p": ("top_p", float), "--seed": ("seed", int)}
    for flag, value in zip(args[::2], args[1::2] + [None] * (len(args) % 2)):
        if flag not in names:
            raise ValueError(f"unknown argument {flag!r}; {USAGE}")
        if value is None:
            raise ValueError(f"{flag} needs a value")
        name, kind = names[flag]
        try:
            options[name] = kind(value)
        except ValueError:
            raise ValueError(f"invalid number for {flag}: {value!r}") from None
    for required in ("prompt", "max_tokens"):
        if required not in options:
            raise ValueError(f"--{required.replace('_', '-')} is required")
    return options


def main(args: list[str]) -> None:
    o = parse(args)
    temperature = o["temperature"] if o["temperature"] is not None else (1.0 if o["top_p"] is not None else 0.0)
    sampler = inferlet.Sampler(temperature=temperature, top_p=o["top_p"] or 1.0, seed=o["seed"])
    ctx = inferlet.Model.default().create_context()
    messages = ([inferlet.chat("system", o["system"])] if o["system"] else []) + [inferlet.chat("user", o["prompt"])]
    ctx.fill_chat(messages)
    stop = inferlet.Stop(o["max_tokens"], eos=ctx.queue.eos_tokens())
    inferlet.send(ctx.generate(sampler, stop))
