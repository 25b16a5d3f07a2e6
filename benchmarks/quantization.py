"""Int8 weights (`backend.weight_dtype = "int8"`) vs the model dtype: speed and quality.

Three real `pie backend` processes on the same weights: fp32 (the reference, HF-exact),
the dtype `auto` picks on this CPU with the model's weights ("base"), and that dtype with
int8 weights ("int8"); with `auto` = fp32 the first two are one. Quality: greedy
continuations of the 50 chat prompts in benchmarks/data/prompts.txt (all systems decode
the same 50-sequence batch) compared token for token — the share of prompts whose whole
continuation is identical and the mean share of tokens before the first difference — and
perplexity on benchmarks/data/perplexity.txt (an original text, so no model saw it),
scored in passes of 256 tokens on a growing KV context. Speed: the decode step at batch
1, 8 and 32 (context 128) and a 512-token prefill, base and int8 alternating round by
round, each timed as the one fused `pass` request the control layer issues; plus each
backend's load time (int8 quantizes at load) and resident memory.

    python benchmarks/quantization.py [--rounds 5] [--steps 8] [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from array import array
from functools import partial
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the `benchmarks` package is in the repository root

from benchmarks.run_info import alternate, command_line, machine_settings, rotated, write_results
from pie.backend.dtype import resolve_dtype
from pie.backend.weights import resolve_model_dir
from pie.config import load_config
from pie.control.backend_link import BackendError, BackendProcess
from pie.control.direct import DirectBatch, DirectDriver
from pie.control.passes import Output, Pass, encode

RESULTS = ROOT / "benchmarks" / "results"
DATA = ROOT / "benchmarks" / "data"
SCORE_CHUNK = 256  # perplexity: tokens per pass


class Backend:
    """One `pie backend` process, its link, handshake, load time and memory."""

    def __init__(self, name: str, model_dir: Path, dtype: str, weight_dtype: str):
        self.name, self.dtype, self.weight_dtype = name, dtype, weight_dtype
        started = time.monotonic()
        self.process = BackendProcess(model_dir, extra_args=["--dtype", dtype, "--weight-dtype", weight_dtype])
        self.link, self.hs = self.process.connect()
        self.load_s = time.monotonic() - started
        self.rss_mb = _rss_mb(self.process.process.pid)

    def stop(self) -> None:
        self.link.close()
        self.process.stop()

    def greedy(self, prompts: list[list[int]], tokens: int) -> list[list[int]]:
        return DirectDriver(self.link, self.hs).generate(prompts, tokens)

    def log_likelihood(self, tokens: list[int]) -> list[float]:
        """log p(token i+1 | tokens ..i) for every i, one sequence in passes of SCORE_CHUNK."""
        ps = self.hs.page_size
        pages = list(range(math.ceil(len(tokens) / ps)))
        scores: list[float] = []
        for start in range(0, len(tokens) - 1, SCORE_CHUNK):
            chunk = tokens[start:start + SCORE_CHUNK]
            end = start + len(chunk)
            targets = tokens[start + 1:end + 1]
            outputs = [Output(i, logprob_ids=[t]) for i, t in enumerate(targets)]
            p = Pass(None, 0, ps, chunk, list(range(start, end)), [],  # type: ignore[arg-type]
                     pages[: math.ceil(start / ps)], (start - 1) % ps + 1 if start else 0,
                     pages[start // ps: math.ceil(end / ps)], start % ps, None, outputs)
            reply = self.link.call(encode([p]))
            if getattr(reply, "errors", None):
                raise BackendError(f"scoring pass failed: {reply.errors}")  # type: ignore[attr-defined]
            values = array("f")
            values.frombytes(reply.logprobs)  # type: ignore[attr-defined]
            scores += list(values)
        return scores


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def agreement(ours: list[list[int]], reference: list[list[int]]) -> dict:
    """Identical continuations and the mean share of tokens before the first difference."""
    prefix = []
    for a, b in zip(ours, reference):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(same / max(len(b), 1))
    return {"identical": sum(a == b for a, b in zip(ours, reference)) / len(reference),
            "mean_prefix_share": statistics.fmean(prefix), "prompts": len(reference)}


def decode_batch(backend: Backend, batch: int, context: int, steps: int) -> DirectBatch:
    """`batch` prefilled sequences of `context` tokens, one untimed step taken."""
    prompts = [[100 + (b + i) % 1000 for i in range(context)] for b in range(batch)]
    run = DirectBatch(backend.link, backend.hs, prompts, steps + 2)
    run.prefill()
    run.step()  # warm-up, untimed
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds per speed figure (default 5; quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="decode steps timed per round (default 8; quick 2)")
    parser.add_argument("--quick", action="store_true", help="few prompts, tiny sizes, for a smoke run")
    parser.add_argument("--out", default=str(RESULTS / "quantization.json"), help="where the JSON goes")
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 5)
    steps = args.steps or (2 if args.quick else 8)
    n_prompts, new_tokens = (4, 8) if args.quick else (50, 32)
    configs = [(1, 32), (2, 32)] if args.quick else [(b, 128) for b in (1, 8, 32)]
    prefill_tokens = 64 if args.quick else 512

    from transformers import AutoTokenizer

    config = load_config()
    model_dir = resolve_model_dir(config.model.path, config.paths.cache)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    questions = (DATA / "prompts.txt").read_text().splitlines()[:n_prompts]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False), add_special_tokens=False)
        for q in questions]
    text = tokenizer.encode((DATA / "perplexity.txt").read_text())
    text = text[:129] if args.quick else text
    dtype = resolve_dtype("auto", "cpu")
    specs = [("fp32", "float32", "model"), ("base", dtype, "model"), ("int8", dtype, "int8")]
    if dtype == "float32":
        specs = specs[1:]  # base is the reference

    backends: dict[str, Backend] = {}
    try:
        for name, dt, wd in specs:
            print(f"starting {name} ({dt}, weights {wd})", flush=True)
            backends[name] = Backend(name, model_dir, dt, wd)
        reference = "fp32" if "fp32" in backends else "base"
        quality: dict = {}
        outputs = {}
        for name, backend in backends.items():
            outputs[name] = backend.greedy(prompts, new_tokens)
            scores = backend.log_likelihood(text)
            quality[name] = {"perplexity": math.exp(-statistics.fmean(scores)), "scored_tokens": len(scores)}
        for name in backends:
            quality[name]["agreement_with_fp32"] = agreement(outputs[name], outputs[reference])
            quality[name]["agreement_with_base"] = agreement(outputs[name], outputs["base"])
            print(f"{name:5s} perplexity {quality[name]['perplexity']:.3f}  identical to fp32 "
                  f"{quality[name]['agreement_with_fp32']['identical']:.0%}, to base "
                  f"{quality[name]['agreement_with_base']['identical']:.0%}", flush=True)

        speed: dict = {"prefill": {}, "decode": []}
        sides = ["base", "int8"]
        order = [rotated(sides, r) for r in range(rounds)]
        long_prompt = [[100 + i % 1000 for i in range(prefill_tokens)]]
        for side in sides:  # warm-up, untimed
            backends[side].greedy(long_prompt, 1)
        prefill_s = alternate(order, {s: partial(backends[s].greedy, long_prompt, 1) for s in sides})
        speed["prefill"] = {"tokens": prefill_tokens, **{
            f"{s}_tokens_per_s": prefill_tokens / statistics.median(prefill_s[s]) for s in sides},
            **{f"{s}_round_s": prefill_s[s] for s in sides}}
        speed["prefill"]["int8_over_base"] = speed["prefill"]["int8_tokens_per_s"] / speed["prefill"]["base_tokens_per_s"]
        for batch, context in configs:
            runs = {s: decode_batch(backends[s], batch, context, rounds * steps) for s in sides}
            step_s = alternate(order, {s: runs[s].step for s in sides}, steps)
            row = {"batch": batch, "context": context, "steps": rounds * steps,
                   **{f"{s}_step_ms": 1e3 * statistics.median(step_s[s]) for s in sides},
                   **{f"{s}_step_ms_all": [round(1e3 * t, 3) for t in step_s[s]] for s in sides}}
            row["base_over_int8_time"] = row["base_step_ms"] / row["int8_step_ms"]
            speed["decode"].append(row)
            print(f"decode B={batch:2d} L={context}: base {row['base_step_ms']:6.2f} ms  int8 "
                  f"{row['int8_step_ms']:6.2f} ms  speed-up {row['base_over_int8_time']:.2f}x", flush=True)
        startup = {name: {"load_s": round(b.load_s, 2), "rss_mb": round(b.rss_mb)} for name, b in backends.items()}
    finally:
        for backend in backends.values():
            backend.stop()

    results = {"quality": quality, "speed": speed, "startup": startup, "meta": {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command_line(),
        "quick": args.quick, "rounds": rounds, "order": order, "steps_per_round": steps,
        "model": model_dir.name, "dtype": dtype, "reference": reference,
        "systems": {name: {"dtype": b.dtype, "weight_dtype": b.weight_dtype, "handshake_dtype": b.hs.dtype}
                    for name, b in backends.items()},
        "prompts": len(prompts), "new_tokens": new_tokens, **machine_settings(),
        "method": "greedy continuations of one 50-prompt batch per system, compared token for token; "
                  "perplexity from the fused pass's log-probabilities; speed as medians over "
                  "alternating rounds after an untimed warm-up, real backend processes over ZeroMQ",
    }}
    write_results(args.out, results)


if __name__ == "__main__":
    main()
