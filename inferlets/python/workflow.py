"""`workflow`: an agentic workflow (Helium) as a graph of operators, checked, optimized and run
inside one instance (`inferlet.workflow`).

Arguments: `--spec JSON [--input NAME=VALUE ...] [--naive | --no OPT[,OPT]] [--pin | --unpin]`, where the
spec is `inferlet.workflow`'s (inputs, nodes of op llm / format / fn, outputs) and OPT one of
prune, merge, cache, prefixes, order; `--naive` turns them all off (every operator as
declared, nothing reused); `--pin` keeps the shared prefixes as persistent exports for later
runs, `--unpin` removes them (and runs nothing). Functions for `fn` nodes: `first_line`,
`strip`, `upper`, `lower` (one binding, `text`) and `join` (every bound string, one per line,
in binding-name order).
Output: one JSON message {"outputs": {name: text}, "stats": {declared, kept, llm_calls,
cache_hits, prefixes_prefilled, prefixes_imported}}; with `--unpin`, {"unpinned": N}.
"""

import json
from dataclasses import replace

import inferlet
from inferlet.workflow import FUNCTIONS, Options, compile_workflow

USAGE = "usage: --spec JSON [--input NAME=VALUE ...] [--naive | --no OPT[,OPT...]] [--pin | --unpin]"
OPTIMIZATIONS = ("prune", "merge", "cache", "prefixes", "order")


def main(args: list[str]) -> None:
    spec, inputs, options, unpin = None, {}, Options(), False
    rest = iter(args)
    for flag in rest:
        if flag == "--unpin":
            unpin = True
            continue
        if flag == "--naive":
            options = replace(Options.naive(), pin=options.pin)
            continue
        if flag == "--pin":
            options = replace(options, pin=True)
            continue
        value = next(rest, None)
        if value is None:
            raise ValueError(f"{flag} needs a value; {USAGE}")
        if flag == "--spec":
            spec = json.loads(value)
        elif flag == "--input":
            name, eq, text = value.partition("=")
            if not eq:
                raise ValueError(f"--input takes NAME=VALUE, got {value!r}")
            inputs[name] = text
        elif flag == "--no":
            off = [o for o in value.split(",") if o]
            unknown = [o for o in off if o not in OPTIMIZATIONS]
            if unknown:
                raise ValueError(f"--no: unknown optimization {unknown[0]!r} (from {', '.join(OPTIMIZATIONS)})")
            options = replace(options, **{o: False for o in off})
        else:
            raise ValueError(f"unknown argument {flag!r}; {USAGE}")
    if spec is None:
        raise ValueError(f"--spec is required; {USAGE}")
    plan = compile_workflow(spec, options, tuple(FUNCTIONS))
    if unpin:
        inferlet.send(json.dumps({"unpinned": plan.unpin(inferlet.Model.default())}))
        return
    outputs = plan.run(inferlet.Model.default(), inputs, FUNCTIONS)
    inferlet.send(json.dumps({"outputs": outputs, "stats": plan.stats}))
