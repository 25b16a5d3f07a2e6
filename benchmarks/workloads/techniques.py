"""Fig. 8 of the paper: inference techniques, each as a Pie inferlet and as a client script.

Why: the paper's claim is that techniques which need control over the KV cache or the
decoding loop (forked thoughts, recursion, beams, grammar masks, draft verification, cache
eviction) run as well or better as inferlets than as application code driving a serving
engine through its API. So every technique runs twice over the same model:

- Pie runs the existing inferlet (`inferlets/<name>`): forks share KV pages, branches
  decode in lockstep, scoring reads next-token distributions, nothing leaves the server.
- Every OpenAI endpoint (the baselines, and Pie's own `/v1` as "pie (client-side)") runs
  the same technique as client-side Python doing the same generation work: each
  generation is one request carrying the whole text so far (the engine's own prefix cache,
  if any, is what avoids re-prefilling), branches are `n` choices or concurrent requests,
  scores are top-k logprobs. Where the engine's API has the technique built in (vLLM's
  beam search, native JSON-schema / grammar output) the baseline uses it instead.

The metric is the median wall-clock latency of one task over `bench.rounds` rounds, the
systems alternating within each round (full mode adds one untimed warm-up round). Each
row's `extra` records the generated tokens and requests per task, so comparable work can
be checked. Prompts and the chat rendering are SmolLM2-Instruct's (the suite's model).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from benchmarks.endpoint import Completion, Endpoint
from benchmarks.workloads import Bench, Metric, Result, Row
from pie.server.rpc import RpcError


@dataclass(frozen=True)
class Sizes:
    """How much each task generates; each field is an inferlet argument (tot_breadth: tree_of_thought's
    --breadth), which the client side uses alike."""

    tot_breadth: int  # ToT: thoughts per level
    tot_depth: int  # ToT: levels
    thought_tokens: int  # ToT and GoT: tokens per thought
    rot_depth: int  # RoT: levels of recursion
    rot_step_tokens: int  # RoT: tokens per sub-question or answer
    got_thoughts: int  # GoT: thoughts aggregated
    skot_points: int  # SkoT: points expanded in parallel
    skeleton_tokens: int
    point_tokens: int
    prefix_records: int  # prefix caching: lines in the shared document (~16 tokens each)
    prefix_questions: int  # questions asked, one after another, about the document
    answer_tokens: int
    beams: int
    beam_tokens: int
    json_tokens: int  # constrained decoding: the most tokens the output may take
    spec_tokens: int  # speculative decoding: greedy tokens (fewer if the model ends first)
    sink_tokens: int  # attention sink: tokens generated (EOS ignored)
    sinks: int
    window: int


QUICK = Sizes(tot_breadth=3, tot_depth=2, thought_tokens=4, rot_depth=2, rot_step_tokens=4, got_thoughts=3,
              skot_points=3, skeleton_tokens=24, point_tokens=4, prefix_records=8, prefix_questions=2,
              answer_tokens=4, beams=3, beam_tokens=4, json_tokens=48, spec_tokens=16, sink_tokens=16,
              sinks=4, window=8)
FULL = Sizes(tot_breadth=3, tot_depth=3, thought_tokens=16, rot_depth=4, rot_step_tokens=12, got_thoughts=4,
             skot_points=4, skeleton_tokens=48, point_tokens=24, prefix_records=80, prefix_questions=4,
             answer_tokens=16, beams=3, beam_tokens=16, json_tokens=48, spec_tokens=128, sink_tokens=256,
             sinks=4, window=32)

# --- prompts -------------------------------------------------------------------------------

PROBLEM = "A farmer has 3 fields with 12 cows each. How many cows are there in total?"
OPEN_QUESTION = "How can a city reduce traffic?"
SKOT_QUESTION = "How do I learn to cook?"  # SmolLM2-135M reliably numbers its points for this one
BEAM_PROMPT = "Write one sentence about the ocean."
SINK_PROMPT = "Write a long story about a lighthouse keeper and the sea."
SPEC_PROMPT = ("Repeat this paragraph exactly:\nThe old library stood at the end of the street. Every morning the "
               "librarian opened the heavy doors, dusted the long wooden tables and sorted the returned books. "
               "Children came after school to read stories, and old men came to read the newspapers.")
PERSON_PROMPT = "Describe a person as JSON with a name and an age."
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 150}},
                 "required": ["name", "age"], "additionalProperties": False}
# The same JSON object as an EBNF grammar, in GBNF notation (Pie, llama.cpp, vLLM and SGLang all read it).
PERSON_GBNF = ('root ::= "{" ws "\\"name\\":" ws name "," ws "\\"age\\":" ws age ws "}"\n'
               'name ::= "\\"" [A-Za-z ]{1,20} "\\""\n'
               'age ::= [0-9] | [1-9] [0-9] | "1" [0-4] [0-9]\n'
               'ws ::= " "?\n')
QUESTIONS = ["Where does employee 3 live?", "What is the job of employee 5?", "Who is employee 2?",
             "Which employees live in Oslo?"]
# tree_of_thought's judge turn, verbatim.
TOT_JUDGE = ("<|im_end|>\n<|im_start|>user\nIs this a good next step toward solving the problem? "
             "Answer yes or no.<|im_end|>\n<|im_start|>assistant\n")
EOS_TEXTS = {"<|im_end|>", "<|endoftext|>", ""}  # how an end-of-sequence token shows in top logprobs


def chat(user: str) -> str:
    """One user turn under SmolLM2-Instruct's chat template (its default system prompt), ready
    for the reply: the text the inferlets' `fill_chat` renders."""
    return ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")


def turn(user: str) -> str:
    """Closes the assistant turn and opens a new user turn and reply, as the inferlets do."""
    return f"<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def document(records: int) -> str:
    """The long shared prefix for prefix caching: a staff directory."""
    names = ["Alice", "Bob", "Chen", "Dana", "Emil", "Farah", "Goran", "Hana", "Ivan", "Jia", "Kofi"]
    cities = ["Lisbon", "Oslo", "Lima", "Kyoto", "Accra", "Quito", "Perth", "Riga"]
    jobs = ["baker", "pilot", "nurse", "welder", "teacher", "chemist", "farmer"]
    lines = [f"Employee {i}: {names[i % len(names)]} lives in {cities[i % len(cities)]} and works as a "
             f"{jobs[i % len(jobs)]}." for i in range(records)]
    return "Answer questions about this staff directory in one short sentence.\n" + "\n".join(lines)


# --- what a run did ------------------------------------------------------------------------

@dataclass
class Work:
    tokens: int | None  # generated tokens (None where the inferlet does not report them)
    requests: int  # OpenAI requests (client side) or inferlet launches (Pie)
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Client:
    """An endpoint as one client-side task sees it, counting what the task asks of it."""

    endpoint: Endpoint
    requests: int = 0
    tokens: int = 0  # generated tokens, every choice of every `complete`
    prompt_tokens: int = 0  # prompt tokens sent (before the engine's prefix cache)

    async def complete(self, prompt: str, max_tokens: int, **options: Any) -> list[Completion]:
        out = await self.endpoint.complete(prompt, max_tokens, **options)
        self.requests += 1
        self.tokens += sum(c.completion_tokens for c in out)
        self.prompt_tokens += out[0].prompt_tokens
        return out

    async def next_token_logprobs(self, prompt: str, k: int) -> dict[str, float]:
        """The k most likely next tokens after `prompt` and their log-probabilities: one
        1-token request (EOS allowed as that token), whose token is not counted as output."""
        [out] = await self.endpoint.complete(prompt, 1, logprobs=k, ignore_eos=True)
        self.requests += 1
        self.prompt_tokens += out.prompt_tokens
        if not out.logprobs:  # Pie's /v1 reports no distribution for an EOS passed over by ignore_eos
            raise RuntimeError(f"{self.endpoint.engine}: no logprobs for the next token (EOS was its choice)")
        return out.logprobs[0]

    def work(self, tokens: int | None = None, **detail: Any) -> Work:
        return Work(self.tokens if tokens is None else tokens, self.requests,
                    {"prompt_tokens_sent": self.prompt_tokens, **detail})


async def inferlet(bench: Bench, name: str, *args: object) -> tuple[Any, dict[str, Any]]:
    """Runs `inferlets/<name>` on Pie; its (JSON) message and what it consumed."""
    launch = await bench.launch(name, [str(a) for a in args])
    return json.loads(launch.messages[-1]), {"forward_tokens": launch.usage.get("forward_tokens")}


# --- Tree of Thoughts ----------------------------------------------------------------------

async def pie_tot(bench: Bench, s: Sizes) -> Work:
    out, usage = await inferlet(bench, "tree_of_thought", "--prompt", PROBLEM, "--breadth", s.tot_breadth,
                                "--depth", s.tot_depth, "--thought-tokens", s.thought_tokens)
    return Work(sum(out["branch_tokens"]), 1, usage)


async def client_tot(c: Client, s: Sizes) -> Work:
    """Per level: `breadth` sampled thoughts (one request, n choices) from the whole text so
    far; each judged by P("yes") in the top-5 logprobs (concurrent requests); the best kept."""
    text = chat(f"Problem: {PROBLEM}\nSolve it step by step. Write one short step at a time.")
    for _ in range(s.tot_depth):
        thoughts = await c.complete(text, s.thought_tokens, temperature=0.8, n=s.tot_breadth)
        judged = await asyncio.gather(*(c.next_token_logprobs(text + t.text + TOT_JUDGE, 5) for t in thoughts))
        scores = [sum(math.exp(lp) for token, lp in dist.items() if token.lstrip(" ") in ("yes", "Yes"))
                  for dist in judged]
        text += thoughts[scores.index(max(scores))].text + "\n"
    return c.work()


# --- Recursion of Thought ------------------------------------------------------------------

def rot_request(question: str, decompose: bool) -> str:
    task = "Before answering, ask one simpler sub-question that would help." if decompose else "Answer briefly."
    return f"Question: {question}\n{task}"


async def pie_rot(bench: Bench, s: Sizes) -> Work:
    out, usage = await inferlet(bench, "recursion_of_thought", "--prompt", PROBLEM, "--depth", s.rot_depth,
                                "--step-tokens", s.rot_step_tokens)
    return Work(None, 1, {**usage, "levels": len(out["levels"])})


async def client_rot(c: Client, s: Sizes) -> Work:
    """The inferlet's recursion, one request per step: each level asks for a sub-question,
    recurses on it in a child prompt (the parent's text plus a new turn), then answers its
    own question given the child's answer; the deepest level answers directly."""
    async def step(text: str) -> str:
        [out] = await c.complete(text, s.rot_step_tokens, stop=["\n"])
        return out.text

    async def solve(text: str, question: str, level: int) -> str:
        if level < s.rot_depth:
            text += "Sub-question:"
            generated = await step(text)
            text += generated
            sub = generated.strip()
            answer = await solve(text + turn(rot_request(sub, level + 1 < s.rot_depth)), sub, level + 1)
            text += turn(f'The answer to your sub-question is: {answer}\nNow answer the question "{question}" briefly.')
        return (await step(text)).strip()

    await solve(chat(rot_request(PROBLEM, s.rot_depth > 0)), PROBLEM, 0)
    return c.work(levels=s.rot_depth + 1)


# --- Graph of Thoughts ---------------------------------------------------------------------

async def pie_got(bench: Bench, s: Sizes) -> Work:
    out, usage = await inferlet(bench, "graph_of_thought", "--prompt", OPEN_QUESTION, "--thoughts", s.got_thoughts,
                                "--thought-tokens", s.thought_tokens)
    return Work(sum(out["branch_tokens"]), 1, usage)


async def client_got(c: Client, s: Sizes) -> Work:
    """k sampled thoughts (n choices), an aggregation request listing them all after the
    root prompt, then a refinement request continuing the aggregation."""
    root = chat(f"Question: {OPEN_QUESTION}\nGive one short idea for the answer.")
    thoughts = await c.complete(root, s.thought_tokens, temperature=0.8, n=s.got_thoughts)
    ideas = "\n".join(f"Idea {i + 1}: {t.text.strip()}" for i, t in enumerate(thoughts))
    aggregation = root + ideas + turn("Combine these ideas into one better answer.")
    [aggregated] = await c.complete(aggregation, s.thought_tokens + 4)
    await c.complete(aggregation + aggregated.text + turn("Improve that answer in one sentence."), s.thought_tokens + 4)
    return c.work()


# --- Skeleton of Thought -------------------------------------------------------------------

def skeleton_points(skeleton: str) -> list[str]:
    """The numbered points ("1. text" or "1) text") of a skeleton, as the inferlet parses them."""
    matches = (re.match(r"(\d+)[.)](.*)", line.strip().lstrip("-* ")) for line in skeleton.splitlines())
    return [m[2].strip() for m in matches if m and m[2].strip()]


def skot_ask(points: int) -> str:
    return (f"Question: {SKOT_QUESTION}\nWrite only a skeleton of the answer: a numbered list of {points} points, "
            "3 to 5 words each, one per line.")


async def pie_skot(bench: Bench, s: Sizes) -> Work:
    out, usage = await inferlet(bench, "skeleton_of_thought", "--prompt", SKOT_QUESTION, "--points", s.skot_points,
                                "--skeleton-tokens", s.skeleton_tokens, "--point-tokens", s.point_tokens)
    return Work(out["skeleton_tokens"] + sum(out["expansion_tokens"]), 1, {**usage, "points": len(out["points"])})


async def client_skot(c: Client, s: Sizes) -> Work:
    """The skeleton greedily, then every point expanded by its own request, concurrently,
    each sending the question + skeleton + its instruction."""
    prompt = chat(skot_ask(s.skot_points))
    [skeleton] = await c.complete(prompt, s.skeleton_tokens)
    points = skeleton_points(skeleton.text)[:s.skot_points]
    if not points:
        raise RuntimeError(f"the skeleton has no numbered points: {skeleton.text!r}")
    await asyncio.gather(*(c.complete(prompt + skeleton.text + turn(
        f'Explain point {i + 1} of your list, "{point}", in one sentence.'), s.point_tokens)
        for i, point in enumerate(points)))
    return c.work(points=len(points))


# --- prefix caching ------------------------------------------------------------------------

async def pie_prefix(bench: Bench, s: Sizes) -> Work:
    forward, cached = 0, 0
    for question in QUESTIONS[:s.prefix_questions]:
        out, usage = await inferlet(bench, "prefix_caching", "--prefix", document(s.prefix_records),
                                    "--question", question, "--max-tokens", s.answer_tokens)
        forward += usage["forward_tokens"] or 0
        cached += out["cached"]
    return Work(None, s.prefix_questions, {"forward_tokens": forward, "prefix_tokens": out["prefix_tokens"],
                                           "answers_from_cache": cached})


async def pie_prefix_clear(bench: Bench, s: Sizes) -> None:
    """Drops the inferlet's persistent export of the document."""
    await bench.launch("prefix_caching", ["--prefix", document(s.prefix_records), "--clear"])


async def client_prefix(c: Client, s: Sizes) -> Work:
    """The questions one after another, each request sending the whole document first."""
    system = f"<|im_start|>system\n{document(s.prefix_records)}<|im_end|>\n"
    for question in QUESTIONS[:s.prefix_questions]:
        await c.complete(f"{system}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n", s.answer_tokens)
    return c.work()


# --- beam search ---------------------------------------------------------------------------

async def pie_beam(bench: Bench, s: Sizes) -> Work:
    out, usage = await inferlet(bench, "beam_search", "--prompt", BEAM_PROMPT, "--beams", s.beams,
                                "--max-tokens", s.beam_tokens)
    return Work(sum(len(b["tokens"]) for b in out["beams"]), 1, usage)


@dataclass
class Beam:
    text: str
    logprob: float
    tokens: int


async def client_beam(c: Client, s: Sizes) -> Work:
    """The inferlet's algorithm one token at a time: every live beam's top-B next tokens
    (one 1-token request per beam, concurrent), the B best extensions by total logprob
    kept; a beam ends at EOS. Beams are extended as text, so the engine re-tokenizes."""
    prompt = chat(BEAM_PROMPT)
    live, done = [Beam("", 0.0, 0)], []
    for _ in range(s.beam_tokens):
        if not live:
            break
        dists = await asyncio.gather(*(c.next_token_logprobs(prompt + b.text, s.beams) for b in live))
        candidates = sorted(((b, token, b.logprob + lp) for b, dist in zip(live, dists) for token, lp in dist.items()),
                            key=lambda x: x[2], reverse=True)[:s.beams]
        live = []
        for beam, token, logprob in candidates:
            ended = token in EOS_TEXTS
            (done if ended else live).append(Beam(beam.text + ("" if ended else token), logprob, beam.tokens + 1))
    best = sorted(done + live, key=lambda b: b.logprob, reverse=True)[:s.beams]
    return c.work(sum(b.tokens for b in best))


async def engine_beam(c: Client, s: Sizes) -> Work:
    """vLLM's own beam search (`use_beam_search`, `n` beams), run inside the server."""
    beams = await c.complete(chat(BEAM_PROMPT), s.beam_tokens, n=s.beams, beam_search=True)
    return c.work(engine_beam_search=True, beams=len(beams))


# --- constrained decoding ------------------------------------------------------------------

async def pie_json(bench: Bench, s: Sizes) -> Work:
    out, usage = await inferlet(bench, "constrained_decoding", "--prompt", PERSON_PROMPT,
                                "--json-schema", json.dumps(PERSON_SCHEMA), "--max-tokens", s.json_tokens)
    return Work(None, 1, {**usage, "output": json.dumps(out)})


async def client_json(c: Client, s: Sizes) -> Work:
    """The engine's native JSON-schema output; the result must parse."""
    [out] = await c.complete(chat(PERSON_PROMPT), s.json_tokens, json_schema=PERSON_SCHEMA)
    return c.work(output=json.dumps(json.loads(out.text)))


async def pie_ebnf(bench: Bench, s: Sizes) -> Work:
    out, usage = await inferlet(bench, "constrained_decoding", "--prompt", PERSON_PROMPT, "--ebnf", PERSON_GBNF,
                                "--max-tokens", s.json_tokens)
    return Work(None, 1, {**usage, "output": json.dumps(out)})


async def client_ebnf(c: Client, s: Sizes) -> Work:
    """The engine's native grammar-constrained output (GBNF); the result must parse."""
    [out] = await c.complete(chat(PERSON_PROMPT), s.json_tokens, grammar=PERSON_GBNF)
    return c.work(output=json.dumps(json.loads(out.text)))


# --- speculative decoding and attention sink -----------------------------------------------

async def pie_spec(bench: Bench, s: Sizes) -> Work:
    out, usage = await inferlet(bench, "speculative_decoding", "--prompt", SPEC_PROMPT, "--max-tokens",
                                s.spec_tokens, "--ngram", 3)
    return Work(out["tokens"], 1, {**usage, "steps": out["steps"], "accepted": out["accepted"]})


async def client_greedy_spec(c: Client, s: Sizes) -> Work:
    """Plain greedy decoding of the same prompt: the same tokens, one forward pass each."""
    await c.complete(chat(SPEC_PROMPT), s.spec_tokens)
    return c.work()


async def pie_sink(bench: Bench, s: Sizes) -> Work:
    out, usage = await inferlet(bench, "attention_sink", "--prompt", SINK_PROMPT, "--max-tokens", s.sink_tokens,
                                "--sinks", s.sinks, "--window", s.window, "--ignore-eos")
    return Work(out["tokens"], 1, {**usage, "max_pages": out["max_pages"]})


async def client_greedy_sink(c: Client, s: Sizes) -> Work:
    """Plain greedy decoding of as many tokens, attending to the whole (unbounded) cache."""
    await c.complete(chat(SINK_PROMPT), s.sink_tokens, ignore_eos=True)
    return c.work()


# --- the table -----------------------------------------------------------------------------

PieRunner = Callable[[Bench, Sizes], Awaitable[Work]]
ClientRunner = Callable[[Client, Sizes], Awaitable[Work]]
NO_GRAMMAR = "Pie's OpenAI endpoint takes JSON schemas (response_format), not GBNF grammars (the constrained_decoding inferlet does)"


@dataclass(frozen=True)
class Case:
    name: str  # the row label (the paper's Fig. 8)
    inferlet: str  # what `pie` launches (built and uploaded before any timing)
    pie: PieRunner
    client: ClientRunner  # the client-side script, on any OpenAI endpoint
    how: str  # for the notes: what the endpoints run
    native: dict[str, ClientRunner] = field(default_factory=dict)  # engine -> its own API for the technique
    unsupported: dict[str, str] = field(default_factory=dict)  # engine -> why it cannot run the case
    cleanup: Callable[[Bench, Sizes], Awaitable[None]] | None = None  # on Pie, after the last round


CASES = [
    Case("ToT", "tree_of_thought", pie_tot, client_tot,
         "per level, n sampled thoughts in one request, each judged by a concurrent 1-token request's logprobs"),
    Case("RoT", "recursion_of_thought", pie_rot, client_rot,
         "the same recursion, one request per sub-question or answer, each resending its whole context"),
    Case("GoT", "graph_of_thought", pie_got, client_got,
         "n sampled thoughts in one request, then aggregation and refinement requests"),
    Case("SkoT", "skeleton_of_thought", pie_skot, client_skot,
         "a skeleton request, then one concurrent request per point"),
    Case("prefix caching", "prefix_caching", pie_prefix, client_prefix,
         "every question resends the document; the engine's own prefix cache, if any, is the technique",
         cleanup=pie_prefix_clear),
    Case("beam search", "beam_search", pie_beam, client_beam,
         "client-side beam search over top-k logprobs, one 1-token request per beam per step; "
         "vLLM uses its own beam search (use_beam_search)", native={"vllm": engine_beam}),
    Case("JSON schema", "constrained_decoding", pie_json, client_json,
         "the engine's native JSON-schema output (Pie: response_format)"),
    Case("EBNF", "constrained_decoding", pie_ebnf, client_ebnf,
         "the engine's native grammar (GBNF) output", unsupported={"pie": NO_GRAMMAR}),
    Case("speculative decoding", "speculative_decoding", pie_spec, client_greedy_spec,
         "plain greedy decoding of the same tokens (the baseline user's alternative: vLLM's n-gram "
         "speculation is a server-wide flag, off here)"),
    Case("attention sink", "attention_sink", pie_sink, client_greedy_sink,
         "plain greedy decoding of as many tokens over the full KV cache (no engine here offers attention sinks)"),
]


def runners(bench: Bench, case: Case, s: Sizes, notes: list[str]) -> dict[str, Callable[[], Awaitable[Work]]]:
    """System name -> one run of the case's task; unsupported systems noted instead."""
    out: dict[str, Callable[[], Awaitable[Work]]] = {}
    if bench.pie is not None:
        out["pie"] = lambda: case.pie(bench, s)
    for name, endpoint in bench.endpoints.items():
        system = "pie (client-side)" if name == "pie" else name
        if endpoint.engine in case.unsupported:
            notes.append(f"{case.name} on {system}: not supported ({case.unsupported[endpoint.engine]}).")
            continue
        runner = case.native.get(endpoint.engine, case.client)
        out[system] = lambda runner=runner, endpoint=endpoint: runner(Client(endpoint), s)
    return out


Samples = dict[tuple[str, str], list[tuple[float, Work]]]  # (case, system) -> (seconds, work) per round


async def measure(bench: Bench, table: dict[str, dict[str, Callable[[], Awaitable[Work]]]], warmup: int,
                  failed: dict[tuple[str, str], str]) -> Samples:
    """Every case on every system, `warmup` untimed rounds then `bench.rounds` timed ones, the
    systems' order rotating each round. A system that fails a case is noted in `failed` and
    not asked again."""
    samples: Samples = {}
    for round_ in range(warmup + bench.rounds):
        for case, systems in table.items():
            names, k = list(systems), round_ % max(len(systems), 1)
            for system in names[k:] + names[:k]:
                if (case, system) in failed:
                    continue
                await bench.settle()
                start = time.perf_counter()
                try:
                    work = await systems[system]()
                except (RuntimeError, ValueError, OSError, httpx.HTTPError, RpcError) as e:  # noted, not fatal
                    failed[case, system] = f"{type(e).__name__}: {e}"[:300]
                    bench.log(f"techniques: {case} on {system} failed: {failed[case, system]}")
                    continue
                seconds = time.perf_counter() - start
                bench.log(f"techniques: {case} on {system}: {seconds:.2f} s, {work.tokens} tokens, "
                          f"{work.requests} requests" + (" (warm-up)" if round_ < warmup else ""))
                if round_ >= warmup:
                    samples.setdefault((case, system), []).append((seconds, work))
    return samples


async def run(bench: Bench) -> Result:
    s = QUICK if bench.quick else FULL
    warmup = 0 if bench.quick else 1
    notes: list[str] = []
    table = {case.name: runners(bench, case, s, notes) for case in CASES}
    if bench.pie is not None:
        for case in CASES:
            await bench.program(case.inferlet)
    failed: dict[tuple[str, str], str] = {}
    samples = await measure(bench, table, warmup, failed)
    if bench.pie is not None:
        for case in CASES:
            if case.cleanup is not None:
                await case.cleanup(bench, s)

    rows = []
    for (case, system), runs in samples.items():
        last = runs[-1][1]
        values = {"latency_s": statistics.median(t for t, _ in runs)}
        tokens = {}
        if last.tokens is not None:
            tokens = {"generated_tokens": [w.tokens for _, w in runs]}
            if all(w.tokens for _, w in runs):
                values["ms_per_token"] = statistics.median(1e3 * t / w.tokens for t, w in runs)
        rows.append(Row(case, system, values,
                        {"samples_s": [round(t, 3) for t, _ in runs], **tokens, "requests": last.requests,
                         **last.detail}))
    notes += [f"{case} on {system}: not run ({error})." for (case, system), error in failed.items()]
    notes += [f"{case.name} — endpoints: {case.how}." for case in CASES]
    notes.append("Pie runs each technique as its inferlet (inferlets/<name>); 'pie (client-side)' runs the "
                 "endpoints' script against Pie's own /v1.")
    notes.append("Sampled thoughts end at EOS, so the systems generate different token counts for the same task "
                 "(see generated_tokens): ms_per_token = task latency / tokens generated normalises that; it is "
                 "blank where a system does not report its tokens (Pie's RoT, prefix caching and constrained "
                 "decoding inferlets count forwarded tokens instead).")
    return Result(workload="techniques", title="Fig. 8 — techniques",
                  metrics=[Metric("latency_s", "s", False), Metric("ms_per_token", "ms", False)],
                  rows=rows, notes=notes,
                  settings={"rounds": bench.rounds, "warmup_rounds": warmup, "quick": bench.quick, **asdict(s)},
                  counts=["generated_tokens", "requests", "forward_tokens"])
