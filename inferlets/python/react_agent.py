"""A ReAct agent in Python, the twin of inferlets/agent_react (Rust): same prompt, same
loop, same report.

The model writes a thought, then an action `tool[input]`; the inferlet POSTs it to the tool
server and appends the answer as an observation to the SAME context, so only new tokens are
run after each call (the KV cache is kept, never re-prefilled). An action line that does not
parse is cut off and replaced by a scripted action for that step. Decoding is greedy.

Arguments: --tools-url URL --question TEXT [--steps N (3)] [--max-tokens N per line (16)]
Output: one JSON object {"question", "steps": [{"thought", "tool", "input", "observation",
  "source", "model_text"}], "answer", "model_chosen", "scripted", "context_tokens",
  "discarded_tokens", "context"}.
"""

import json
import re

import inferlet

USAGE = "usage: --tools-url URL --question TEXT [--steps N] [--max-tokens N]"
PROMPT = ("Answer the question with tools.\nTools:\n"
          "calculator[expression]: evaluates arithmetic, e.g. calculator[2 * (3 + 4)]\n"
          "search[query]: looks up a fact, e.g. search[capital of Japan]\n"
          "Example:\nQuestion: What is 6 * 7?\nThought: I need to multiply 6 by 7.\nAction: calculator[6 * 7]\n"
          "Observation: 42\nFinal Answer: 42\n\nQuestion: ")
TOOLS = ("calculator", "search")


def parse(args: list[str]) -> dict:
    options = {"--tools-url": None, "--question": None, "--steps": "3", "--max-tokens": "16"}
    for flag, value in zip(args[::2], args[1::2]):
        if flag not in options:
            raise ValueError(f"unknown argument {flag!r}; {USAGE}")
        options[flag] = value
    if options["--tools-url"] is None or options["--question"] is None:
        raise ValueError(USAGE)
    return {"url": options["--tools-url"].rstrip("/"), "question": options["--question"],
            "steps": int(options["--steps"]), "max_tokens": int(options["--max-tokens"])}


def decode_line(ctx: inferlet.Context, max_tokens: int, stops: str) -> tuple[str, bool]:
    """Greedy-decode until a stop character (a ']' is kept, a newline is not) or EOS; the
    text and whether a newline ended it. The last token stays pending."""
    eos = ctx.queue.eos_tokens()
    tokens: list[int] = []
    while len(tokens) < max_tokens:
        token = ctx.decode_step(inferlet.Sampler.greedy())
        if token in eos:
            ctx.truncate(len(ctx) - 1)
            break
        tokens.append(token)
        text = ctx.queue.detokenize(tokens)
        at = min((text.find(c) for c in stops if c in text), default=-1)
        if at >= 0:
            stop = text[at]
            end = at if stop == "\n" else at + 1
            return text[:end], stop == "\n" or "\n" in text[at:]
    return ctx.queue.detokenize(tokens), False


def parse_action(text: str) -> tuple[str, str] | None:
    match = re.match(r"\s*(\w+)\s*\[([^\]]*)\]", text)
    if not match or match.group(1).lower() not in TOOLS or not match.group(2).strip():
        return None
    return match.group(1).lower(), match.group(2).strip()


def scripted_action(step: int, question: str) -> tuple[str, str]:
    """The arithmetic in the question on even steps (if any), else a search for the question."""
    pieces = (s.strip().rstrip(".") for s in re.split(r"[^0-9+\-*/(). ]", question))
    math = next((s for s in pieces if re.search(r"\d", s) and re.search(r"[+\-*/]", s)), None)
    return ("calculator", math) if math and step % 2 == 0 else ("search", question)


def call_tool(url: str, tool: str, text: str) -> str:
    body = {"expression": text} if tool == "calculator" else {"query": text, "k": 1}
    response = inferlet.http_post(f"{url}/tools/{tool}", json.dumps(body),
                                  {"Content-Type": "application/json"}).result()
    answer = json.loads(response.body)
    if "error" in answer:
        observation = str(answer["error"])
    elif tool == "calculator":
        observation = str(answer["result"])
    else:
        observation = answer["results"][0]["text"] if answer["results"] else "no result"
    return observation[:200]


def main(args: list[str]) -> None:
    o = parse(args)
    ctx = inferlet.Model.default().create_context()
    ctx.fill_chat([inferlet.chat("user", PROMPT + o["question"])])
    records, chosen, discarded = [], 0, 0
    for step in range(o["steps"]):
        ctx.fill("Thought:")
        thought, newline = decode_line(ctx, o["max_tokens"], "\n")
        ctx.fill("Action:" if newline else "\nAction:")
        mark = len(ctx)
        text, _ = decode_line(ctx, o["max_tokens"], "\n]")
        action = parse_action(text)
        if action:
            chosen, source = chosen + 1, "model"
        else:
            discarded += max(0, len(ctx.committed) - mark)
            ctx.truncate(mark)
            action, source = scripted_action(step, o["question"]), "scripted"
            ctx.fill(f" {action[0]}[{action[1]}]")
        observation = call_tool(o["url"], *action)
        ctx.fill(f"\nObservation: {observation}\n")
        records.append({"thought": thought.strip(), "tool": action[0], "input": action[1],
                        "observation": observation, "source": source, "model_text": text})
    ctx.fill("Final Answer:")
    answer, _ = decode_line(ctx, o["max_tokens"], "\n")
    inferlet.send(json.dumps({
        "question": o["question"], "steps": records, "answer": answer.strip(), "model_chosen": chosen,
        "scripted": o["steps"] - chosen, "context_tokens": len(ctx), "discarded_tokens": discarded,
        "context": ctx.queue.detokenize(ctx.tokens)}))
