"""Helium's six agentic workflows as `inferlet.workflow` graphs (benchmarks/workflows.py runs
them): each ~30 LLM calls over ~8 agent roles, with a `question` input that only the last
calls read, so a second question on the same data repeats the rest (Helium's "run twice").

- trading: per ticker four analysts, a macro call (the same for every ticker: a duplicate
  subgraph), a bull/bear debate and a trader; a compliance note no output reads (dead code);
  a risk manager and a portfolio manager over every decision;
- mapreduce: four readers map each of six documents, one reduce per reader, an answer;
- debate: six debaters argue the question over four rounds, each reading the others' last
  round; a judge;
- reflect: six writers each draft an answer, take a critic's note and revise, twice; an editor
  picks;
- iterative: three note-takers each carry running notes through eight chunks (a chain each),
  answer from them; a summary of the answers;
- parallel: eight specialists on three aspects of one report, a merge per aspect, an answer;
  a headline no output reads.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.objectives import chunk_text

QUESTIONS = ("Should we add to our positions this week?", "Which of these should we trim before earnings?")


@dataclass(frozen=True)
class Workflow:
    name: str
    build: Callable[[int], dict]  # max_tokens -> the graph (inferlet.workflow's spec)
    data: Callable[[random.Random], dict[str, str]]  # the inputs besides the question


def _llm(max_tokens: int) -> Callable[..., dict]:
    def llm(system: str, body: str, **bind: str) -> dict:
        return {"op": "llm", "template": system + "\n" + body, "bind": bind, "max_tokens": max_tokens}
    return llm


def _join(*sources: str) -> dict:
    return {"op": "fn", "function": "join", "bind": {f"p{i:02d}": s for i, s in enumerate(sources)}}


def _firm(role: str, does: str) -> str:
    return f"You are the {role} of a trading firm. {does}"


TICKERS = ("ACME", "GLOBEX", "INITECH", "UMBRELLA", "HOOLI")
ANALYSTS = {
    "fundamentals": "You are a fundamentals analyst at a trading firm. You judge revenue, margins and debt.",
    "sentiment": "You are a sentiment analyst at a trading firm. You judge what investors feel and say.",
    "news": "You are a news analyst at a trading firm. You judge what the latest events mean for a stock.",
    "technical": "You are a technical analyst at a trading firm. You judge price trends and volumes.",
}
MACRO = _firm("chief economist", "You judge the economy as a whole.")
BULL = _firm("bullish researcher", "You argue for buying.")
BEAR = _firm("bearish researcher", "You argue for selling.")
TRADER = "You are a trader at a trading firm. You decide to buy, hold or sell, in one sentence."
RISK = _firm("risk manager", "You flag the biggest risk in the decisions.")
MANAGER = _firm("portfolio manager", "You set the final allocation.")


def trading(max_tokens: int, tickers: tuple[str, ...] = TICKERS[:3]) -> dict:
    llm = _llm(max_tokens)
    nodes: dict[str, dict] = {}
    for t in tickers:
        for role, system in ANALYSTS.items():
            nodes[f"{role}_{t}"] = llm(system, "Market overview: {{input:m}}\nNews on " + t + ": {{input:n}}\n"
                                       "Your assessment of " + t + " in one sentence:", m="market", n=f"headlines_{t}")
        nodes[f"reports_{t}"] = {"op": "fn", "function": "join", "bind": {r: f"{r}_{t}" for r in ANALYSTS}}
        nodes[f"macro_{t}"] = llm(MACRO, "Market overview: {{input:m}}\nThe outlook in one sentence:", m="market")
        nodes[f"bull_{t}"] = llm(BULL, "Reports on " + t + ":\n{{input:r}}\nOutlook: {{input:x}}\nThe case for " + t + ":",
                                 r=f"reports_{t}", x=f"macro_{t}")
        nodes[f"bear_{t}"] = llm(BEAR, "Reports on " + t + ":\n{{input:r}}\nOutlook: {{input:x}}\nThe case against " + t + ":",
                                 r=f"reports_{t}", x=f"macro_{t}")
        nodes[f"rebuttal_{t}"] = llm(BULL, "The bear says: {{input:b}}\nYour rebuttal:", b=f"bear_{t}")
        nodes[f"trader_{t}"] = llm(TRADER, "Question: {{input:q}}\nFor " + t + ": {{input:a}}\nAgainst: {{input:b}}\n"
                                   "Rebuttal: {{input:c}}\nYour decision on " + t + ":",
                                   q="question", a=f"bull_{t}", b=f"bear_{t}", c=f"rebuttal_{t}")
        nodes[f"compliance_{t}"] = llm(MANAGER, "Write a compliance note on:\n{{input:r}}", r=f"reports_{t}")
    nodes["decisions"] = {"op": "fn", "function": "join", "bind": {t: f"trader_{t}" for t in tickers}}
    nodes["risk"] = llm(RISK, "Question: {{input:q}}\nDecisions:\n{{input:d}}\nThe biggest risk:", q="question", d="decisions")
    nodes["allocation"] = llm(MANAGER, "Question: {{input:q}}\nDecisions:\n{{input:d}}\nRisk: {{input:r}}\n"
                              "The final allocation:", q="question", d="decisions", r="risk")
    return {"inputs": ["question", "market", *(f"headlines_{t}" for t in tickers)], "nodes": nodes,
            "outputs": {"allocation": "allocation", "risk": "risk"}}


def trading_data(rng: random.Random, tickers: tuple[str, ...] = TICKERS[:3]) -> dict[str, str]:
    return {"market": chunk_text(rng, 120), **{f"headlines_{t}": chunk_text(rng, 60) for t in tickers}}


READERS = {
    "facts": "You are a research assistant at a trading firm. You pull out the hard facts of a document.",
    "risks": "You are a risk analyst at a trading firm. You find what could go wrong in a document.",
    "chances": "You are an opportunity scout at a trading firm. You find what could go right in a document.",
    "people": "You are a governance analyst at a trading firm. You note who decides what in a document.",
}
DOCUMENTS = 6


def mapreduce(max_tokens: int) -> dict:
    llm = _llm(max_tokens)
    nodes: dict[str, dict] = {}
    for role, system in READERS.items():
        for d in range(DOCUMENTS):
            nodes[f"{role}_{d}"] = llm(system, "Document:\n{{input:d}}\nIn one sentence:", d=f"doc_{d}")
        nodes[f"{role}_all"] = _join(*(f"{role}_{d}" for d in range(DOCUMENTS)))
        nodes[f"{role}_reduce"] = llm(system, "Your notes on six documents:\n{{input:n}}\nThe common thread:",
                                      n=f"{role}_all")
    nodes["threads"] = _join(*(f"{role}_reduce" for role in READERS))
    nodes["answer"] = llm(MANAGER, "Question: {{input:q}}\nWhat the readers found:\n{{input:t}}\nYour answer:",
                          q="question", t="threads")
    return {"inputs": ["question", *(f"doc_{d}" for d in range(DOCUMENTS))], "nodes": nodes,
            "outputs": {"answer": "answer"}}


def mapreduce_data(rng: random.Random) -> dict[str, str]:
    return {f"doc_{d}": chunk_text(rng, 90) for d in range(DOCUMENTS)}


PERSONAS = ("a cautious pension fund manager", "an aggressive hedge fund trader", "a value investor",
            "a growth investor", "a macro strategist", "a quantitative analyst")
ROUNDS = 4
DEBATE = ("You take part in an investment committee's debate as {persona}. Stay in character.\n"
          "The committee's briefing:\n{{{{input:b}}}}\nQuestion: {{{{input:q}}}}\n")


def debate(max_tokens: int) -> dict:
    llm = _llm(max_tokens)
    nodes: dict[str, dict] = {}
    for r in range(ROUNDS):
        for i, persona in enumerate(PERSONAS):
            opening = DEBATE.format(persona=persona)
            if r == 0:
                nodes[f"say_{r}_{i}"] = llm(opening, "Your opening argument in one sentence:", b="briefing", q="question")
            else:
                others = [f"say_{r - 1}_{j}" for j in range(len(PERSONAS)) if j != i]
                nodes[f"heard_{r}_{i}"] = _join(*others)
                nodes[f"say_{r}_{i}"] = llm(opening, "The others said:\n{{input:o}}\nYour answer now, in one sentence:",
                                            b="briefing", q="question", o=f"heard_{r}_{i}")
    nodes["last"] = _join(*(f"say_{ROUNDS - 1}_{i}" for i in range(len(PERSONAS))))
    nodes["verdict"] = llm(MANAGER, "Question: {{input:q}}\nThe committee's last words:\n{{input:l}}\nYour verdict:",
                           q="question", l="last")
    return {"inputs": ["question", "briefing"], "nodes": nodes, "outputs": {"verdict": "verdict"}}


def debate_data(rng: random.Random) -> dict[str, str]:
    return {"briefing": chunk_text(rng, 150)}


WRITERS = ("an equity analyst", "a credit analyst", "a commodities trader", "a currency strategist",
           "an ESG analyst", "a venture partner")
CRITIC = _firm("head of research", "You find the weakest point of a draft, in one sentence.")
PASSES = 2


def reflect(max_tokens: int) -> dict:
    llm = _llm(max_tokens)
    nodes: dict[str, dict] = {}
    for i, writer in enumerate(WRITERS):
        system = f"You are {writer} at a trading firm, writing for the weekly letter.\nBackground:\n{{{{input:b}}}}"
        nodes[f"draft_{i}_0"] = llm(system, "Question: {{input:q}}\nYour draft answer:", b="background", q="question")
        for p in range(1, PASSES + 1):
            nodes[f"critique_{i}_{p}"] = llm(CRITIC, "A draft:\n{{input:d}}\nIts weakest point:", d=f"draft_{i}_{p - 1}")
            nodes[f"draft_{i}_{p}"] = llm(system, "Question: {{input:q}}\nYour draft: {{input:d}}\n"
                                          "The critique: {{input:c}}\nYour revised answer:",
                                          b="background", q="question", d=f"draft_{i}_{p - 1}", c=f"critique_{i}_{p}")
    nodes["drafts"] = _join(*(f"draft_{i}_{PASSES}" for i in range(len(WRITERS))))
    nodes["letter"] = llm(MANAGER, "Question: {{input:q}}\nThe answers:\n{{input:a}}\nThe one to print, and why:",
                          q="question", a="drafts")
    return {"inputs": ["question", "background"], "nodes": nodes, "outputs": {"letter": "letter"}}


def reflect_data(rng: random.Random) -> dict[str, str]:
    return {"background": chunk_text(rng, 150)}


KEEPERS = {
    "summary": "You keep a running summary of a long filing, read in parts.",
    "timeline": "You keep a timeline of the events in a long filing, read in parts.",
    "numbers": "You keep a list of the key figures in a long filing, read in parts.",
}
CHUNKS = 8


def iterative(max_tokens: int) -> dict:
    llm = _llm(max_tokens)
    nodes: dict[str, dict] = {}
    for role, system in KEEPERS.items():
        for c in range(CHUNKS):
            so_far = {} if c == 0 else {"s": f"{role}_{c - 1}"}
            body = ("Your notes so far: {{input:s}}\n" if c else "") + "Next part:\n{{input:x}}\nYour notes now:"
            nodes[f"{role}_{c}"] = llm(system, body, x=f"part_{c}", **so_far)
        nodes[f"{role}_answer"] = llm(system, "Your notes: {{input:s}}\nQuestion: {{input:q}}\nYour answer from the notes:",
                                      s=f"{role}_{CHUNKS - 1}", q="question")
    nodes["answers"] = _join(*(f"{role}_answer" for role in KEEPERS))
    nodes["summary"] = llm(MANAGER, "Question: {{input:q}}\nAnswers:\n{{input:a}}\nThe answer in one sentence:",
                           q="question", a="answers")
    return {"inputs": ["question", *(f"part_{c}" for c in range(CHUNKS))], "nodes": nodes,
            "outputs": {"summary": "summary"}}


def iterative_data(rng: random.Random) -> dict[str, str]:
    return {f"part_{c}": chunk_text(rng, 60) for c in range(CHUNKS)}


SPECIALISTS = ("an accountant", "a lawyer", "an economist", "an engineer", "a marketer", "a supply-chain expert",
               "a labour-relations expert", "a cybersecurity expert")
ASPECTS = ("strengths", "weaknesses", "threats")


def parallel(max_tokens: int) -> dict:
    llm = _llm(max_tokens)
    nodes: dict[str, dict] = {}
    for a in ASPECTS:
        for i, who in enumerate(SPECIALISTS):
            nodes[f"{a}_{i}"] = llm(f"You are {who} advising a trading firm.\nThe company report:\n{{{{input:r}}}}",
                                    f"Its main {a}, from where you stand, in one sentence:", r="report")
        nodes[f"{a}_all"] = _join(*(f"{a}_{i}" for i in range(len(SPECIALISTS))))
        nodes[f"{a}_merged"] = llm(MANAGER, "The specialists on its " + a + ":\n{{input:s}}\nThe consensus:",
                                   s=f"{a}_all")
    nodes["merged"] = _join(*(f"{a}_merged" for a in ASPECTS))
    nodes["answer"] = llm(MANAGER, "Question: {{input:q}}\nThe consensus:\n{{input:m}}\nYour answer:",
                          q="question", m="merged")
    nodes["headline"] = llm(MANAGER, "A headline for:\n{{input:m}}", m="merged")
    return {"inputs": ["question", "report"], "nodes": nodes, "outputs": {"answer": "answer"}}


def parallel_data(rng: random.Random) -> dict[str, str]:
    return {"report": chunk_text(rng, 150)}


WORKFLOWS = {w.name: w for w in (
    Workflow("trading", trading, trading_data),
    Workflow("mapreduce", mapreduce, mapreduce_data),
    Workflow("debate", debate, debate_data),
    Workflow("reflect", reflect, reflect_data),
    Workflow("iterative", iterative, iterative_data),
    Workflow("parallel", parallel, parallel_data),
)}
