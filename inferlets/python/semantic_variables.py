"""`semantic_variables` in Python: Parrot's chain summary and map-reduce with semantic
variables (`inferlet.semvar`), one program inside one instance.

The twin of inferlets/semantic_variables (Rust), with the same arguments and output:
`--app chain|map-reduce --chunk TEXT [--chunk TEXT ...] [--max-tokens N] [--objective latency|throughput]`
→ one JSON message {"result": text, "calls": N, "summaries": [text, ...]}.
"""

import json

import inferlet
from inferlet.semvar import Pipeline, Template

USAGE = "usage: --app chain|map-reduce --chunk TEXT [--chunk TEXT ...] [--max-tokens N] [--objective latency|throughput]"
CHAIN = ("Keep a running summary of a document read in parts.\nSummary so far: {{input:summary}}\n"
         "Next part: {{input:chunk}}\nReply with the updated summary in one sentence.")
MAP = "Summarize this text in one sentence.\nText: {{input:chunk}}"
REDUCE = "Combine these summaries into one paragraph."


def main(args: list[str]) -> None:
    app, chunks, max_tokens, objective = None, [], 32, "latency"
    for flag, value in zip(args[::2], args[1::2] + [None] * (len(args) % 2)):
        if value is None:
            raise ValueError(f"{flag} needs a value; {USAGE}")
        if flag == "--app":
            app = value
        elif flag == "--chunk":
            chunks.append(value)
        elif flag == "--max-tokens":
            max_tokens = int(value)
        elif flag == "--objective" and value in ("latency", "throughput"):
            objective = value
        else:
            raise ValueError(f"unknown argument {flag!r} or value {value!r}; {USAGE}")
    if not chunks:
        raise ValueError(f"at least one --chunk is required; {USAGE}")
    model = inferlet.Model.default()
    queue = model.create_queue()
    pipeline = Pipeline(model)
    summaries = []
    if app == "chain":
        template = Template.chat(queue, CHAIN, "summary")
        summary = pipeline.input("summary", "(nothing yet)")
        for chunk in chunks:
            (summary,) = pipeline.call(template, {"summary": summary, "chunk": pipeline.input("chunk", chunk)}, max_tokens)
            summaries.append(summary)
        result = summary
    elif app == "map-reduce":
        template = Template.chat(queue, MAP, "summary")
        for chunk in chunks:
            summaries += pipeline.call(template, {"chunk": pipeline.input("chunk", chunk)}, max_tokens)
        slots = "\n".join(f"- {{{{input:s{i}}}}}" for i in range(len(chunks)))
        reduce = Template.chat(queue, f"{REDUCE}\n{slots}", "paragraph")
        (result,) = pipeline.call(reduce, {f"s{i}": s for i, s in enumerate(summaries)}, max_tokens)
    else:
        raise ValueError(f"--app must be chain or map-reduce; {USAGE}")
    text = pipeline.get(result, objective)
    inferlet.send(json.dumps({"result": text, "calls": len(summaries) + (app == "map-reduce"),
                              "summaries": [s.value or "" for s in summaries]}))
