"""End to end through a real `pie serve`: backend process, ZeroMQ, wasmtime, compiled Rust
inferlets, real weights (fp32, so greedy output can be held to HF transformers')."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import msgpack
import pytest
import websockets

from pie.client import PieClient
from pie.server import rpc

from conftest import hf_greedy, hf_probe_continuation
from pie_server import ADMIN, TOKEN, Server, build, forward_batches, until, until_async

PROMPTS = ["What is the capital of France?", "Name three colors.",
           "What is 2 + 2?", "Say hello in Spanish."]


@pytest.fixture(scope="module")
def server(pie_server):
    return pie_server


@pytest.fixture(scope="module")
def probe() -> bytes:
    return build("probe")


@pytest.fixture(scope="module")
def expected(hf_chat) -> dict[str, str]:
    """HF transformers' greedy chat-template completion of each prompt (16 tokens, to EOS)."""
    return {prompt: hf_chat(prompt, 16) for prompt in PROMPTS}


async def complete(url: str, prompts: list[str], max_tokens: int = 16) -> list[tuple[list[str], str]]:
    """Launch one text_completion per prompt at once; (messages, end reason) of each."""
    async with PieClient(url, TOKEN) as client:
        instances = [await client.launch("text_completion", ["--prompt", p, "--max-tokens",
                                                             str(max_tokens)]) for p in prompts]

        async def collect(instance):
            messages = [m async for m in instance]
            return messages, await instance.wait()

        return await asyncio.gather(*(collect(i) for i in instances))


def test_text_completion_equals_hf_greedy(server, expected):
    [(messages, reason)] = asyncio.run(complete(server.ws, [PROMPTS[0]]))
    assert reason == "finished"
    assert messages == [expected[PROMPTS[0]]]
    assert "Paris" in messages[0]


def test_decode_runs_step_ahead_in_the_backend_and_stay_hf_greedy(server, expected):
    """text_completion decodes with a host-side run, whose steps the backend takes on its
    own within each page (control.ahead_steps, docs/fused-pass.md §2.5); two completions
    launched one after the other, the second while the first may be stepping ahead: each
    is still HF's greedy text."""
    before = server.scheduler()

    async def run() -> list[tuple[list[str], str]]:
        async with PieClient(server.ws, TOKEN) as client:
            first = await client.launch("text_completion", ["--prompt", PROMPTS[1], "--max-tokens", "16"])
            await asyncio.sleep(0.2)
            second = await client.launch("text_completion", ["--prompt", PROMPTS[2], "--max-tokens", "16"])

            async def collect(instance):
                return [m async for m in instance], await instance.wait()

            return await asyncio.gather(collect(first), collect(second))

    results = asyncio.run(run())
    assert results == [([expected[PROMPTS[1]]], "finished"), ([expected[PROMPTS[2]]], "finished")]
    assert server.scheduler()["ahead_steps"] > before["ahead_steps"]


def test_sixteen_concurrent_inferlets_are_batched(server, expected):
    """16 text_completions launched while the backend is paused (SIGSTOP): each queues its
    prefill and waits. Once every prefill forward is queued the backend goes on, and the
    scheduler must send them as batches — however slowly the machine ran, no timing
    window decides it. Every answer is still HF's."""
    prompts = PROMPTS * 4
    before = server.scheduler()

    async def run() -> list[tuple[list[str], str]]:
        async with PieClient(server.ws, TOKEN) as client:
            with server.backend_paused():
                submitted = server.scheduler()
                instances = [await client.launch("text_completion", ["--prompt", p, "--max-tokens", "16"])
                             for p in prompts]
                # The first batch the scheduler sent is in flight (held by the paused
                # backend); every other prefill waits.
                await until_async(lambda: server.model_calls_since(submitted) >= len(prompts),
                                  what="every prefill submitted")

            async def collect(instance):
                return [m async for m in instance], await instance.wait()

            return await asyncio.gather(*(collect(i) for i in instances))

    results = asyncio.run(run())
    assert [r for _, r in results] == ["finished"] * 16
    assert [m for m, _ in results] == [[expected[p]] for p in prompts]
    forwards, batches = forward_batches(before, server.scheduler())
    assert batches < forwards, "forward calls were not batched"


@pytest.mark.slow  # restarts a server; tests/test_benchmarks.py runs eager end to end, test_policies its rules
def test_eager_policy_gives_identical_results(tmp_path, server, expected):
    eager = Server(tmp_path, {"control": {"scheduler": "eager"}})
    try:
        results = asyncio.run(complete(eager.ws, PROMPTS * 2))
    finally:
        eager.stop()
    assert [m for m, _ in results] == [[expected[p]] for p in PROMPTS * 2]


def test_export_import_shares_pages(server, probe, hf_model, tokenizer):
    """The importer decodes from the exporter's pages without a prefill of its own: both
    send HF's greedy continuation."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 4

    async def run():
        async with PieClient(server.ws, TOKEN) as client:
            digest = await client.upload(probe)
            exporter = await client.launch(digest, ["export", "shared-prefix", prompt])
            exported = (await exporter.recv()).text
            exports = server.get("/stats")[1]["resources"]["exports"]
            importer = await client.launch(digest, ["import", "shared-prefix", prompt])
            imported = [m async for m in importer]
            await exporter.send("done")
            return exported, exports, imported, await importer.wait(), await exporter.wait()

    exported, exports, imported, importer_end, exporter_end = asyncio.run(run())
    assert exports == 1
    assert exported == hf_probe_continuation(hf_model, tokenizer, prompt)
    assert imported == [exported]
    assert importer_end == exporter_end == "finished"
    assert server.get("/stats")[1]["resources"]["exports"] == 0


def test_bad_inputs_get_clear_errors_and_harm_no_one(server, probe):
    async def run():
        async with PieClient(server.ws, TOKEN) as client:
            bystander = await client.launch("hello", ["still", "here"])
            assert (await bystander.recv()).text == "still here"
            digest = await client.upload(probe)
            outcomes = {}
            for mode in ("forged", "freed", "trap", "panic", "loop", "membomb", "recurse", "println"):
                instance = await client.launch(digest, [mode], logs=True)
                outcomes[mode] = ([m async for m in instance], await instance.wait(), instance.logs)

            errors = {}
            for name, call in {
                "oversized upload": client._call(rpc.UploadBegin, sha256="0" * 64, size=2**27),
                "unknown program": client.launch("no-such-program"),
                "hash mismatch": _mismatched_upload(client),
            }.items():
                with pytest.raises(rpc.RpcError) as e:
                    await call
                errors[name] = e.value.code

            async with websockets.connect(server.ws) as raw:  # no token, then garbage
                await raw.send(rpc.encode(rpc.Launch(corr_id=1, program="hello", arguments=[])))
                errors["unauthenticated"] = msgpack.unpackb(await raw.recv())["code"]
                await raw.send(b"\xc1 not msgpack")
                errors["invalid msgpack"] = msgpack.unpackb(await raw.recv())["code"]

            await bystander.send("ping")
            echo = (await bystander.recv()).text
            await bystander.send("quit")
            return outcomes, errors, echo, await bystander.wait()

    outcomes, errors, echo, bystander_end = asyncio.run(run())
    assert outcomes["forged"][0] == [
        "forward: invalid-handle: kv page 12345 is not a live kv page of this instance",
        "dealloc: invalid-handle: kv page 777 is not a live kv page of this instance"]
    assert all("invalid-handle" in m for m in outcomes["freed"][0])
    assert outcomes["trap"][1].startswith("trap: wasm `unreachable`")
    # a Rust panic names itself, its message and where (the SDK's panic hook), not a guess
    assert outcomes["panic"][1].startswith("trap: panicked at ") and "probe/src/lib.rs:" in outcomes["panic"][1]
    assert outcomes["panic"][1].endswith(": the probe panics on purpose")
    assert outcomes["panic"][2] == [("error", outcomes["panic"][1].removeprefix("trap: "))]  # and the log has it
    assert outcomes["loop"][1].startswith("trap: CPU limit")
    # the SDK's allocator reports the failed allocation, so the limit is named, not guessed
    assert outcomes["membomb"][1].startswith("trap: out of memory: an allocation of 1048576 bytes failed") and \
        outcomes["membomb"][1].endswith("(runtime.memory_limit_mb = 64)"), outcomes["membomb"][1]  # the tests' config
    assert outcomes["recurse"][1].startswith("trap: out of bounds memory access — in a Rust inferlet, a stack "
                                             "overflow"), outcomes["recurse"][1]
    assert outcomes["println"][1:] == ("finished", [("info", "to the log: 2 + 2 = 4"), ("warn", "a warning")])
    assert errors == {"oversized upload": "upload_too_large", "unknown program": "unknown_program",
                      "hash mismatch": "hash_mismatch", "unauthenticated": "unauthenticated",
                      "invalid msgpack": "invalid_message"}
    assert echo == "ping" and bystander_end == "finished"
    status, health = server.get("/health")
    assert status == 200 and health["status"] == "ok"
    resources = server.resources_once_pages_free()
    assert resources["embeds_free"] == resources["embeds_total"]


def test_upload_errors_say_what_the_bytes_are(server, tmp_path):
    """Not a component: say what the bytes are and what to run, not what the parser saw."""
    async def upload(data: bytes) -> str:
        async with PieClient(server.ws, TOKEN) as client:
            with pytest.raises(rpc.RpcError) as e:
                await client.upload(data)
            assert e.value.code == "invalid_program"
            return e.value.message

    said = {name: asyncio.run(upload(data)) for name, data in {
        "random": bytes(range(256)) * 4, "core module": b"\0asm\x01\0\0\0",
        "source": b"import inferlet\n\ndef main(args):\n    pass\n",
        "truncated": build("hello")[:4000]}.items()}
    assert said["random"].startswith("the program is not WebAssembly (no \\0asm header): 1024 bytes")
    assert said["source"].startswith("the program is source text: 42 bytes starting b'import i'")
    assert all("`pie build CRATE_DIR` or `pie build FILE.py`" in said[k] for k in ("random", "source"))
    assert said["core module"].startswith("the program is a core WebAssembly module, not a component")
    assert said["truncated"].startswith("not a valid inferlet component: ") and \
        said["truncated"].endswith("(a damaged or truncated file? build it again with `pie build`)")
    # the CLI: a missing Python file is missing, not "not a Python file"
    done = subprocess.run([sys.executable, "-m", "pie.cli", "run", str(tmp_path / "absent.py")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and f"no such file: {tmp_path / 'absent.py'}" in " ".join(done.stderr.split())


async def _mismatched_upload(client: PieClient) -> None:
    data = b"\0asm not really"
    claimed = hashlib.sha256(b"something else").hexdigest()
    await client._call(rpc.UploadBegin, sha256=claimed, size=len(data))
    await client._call(rpc.UploadChunk, sha256=claimed, data=data)
    await client._call(rpc.UploadEnd, sha256=claimed)


def test_pie_run_prints_the_completion(server, expected):
    done = subprocess.run(
        [sys.executable, "-m", "pie.cli", "run", "text_completion", "--server",
         f"http://{server.address}", "--token", TOKEN, "--", "--prompt", PROMPTS[0],
         "--max-tokens", "16"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected[PROMPTS[0]] + "\n"


def test_pie_run_shows_the_log_on_stderr_or_every_event_as_json(server, probe, tmp_path):
    component = tmp_path / "probe.wasm"
    component.write_bytes(probe)
    pie_run = lambda *flags: subprocess.run(
        [sys.executable, "-m", "pie.cli", "run", str(component), "--server", f"http://{server.address}",
         "--token", TOKEN, *flags, "--", "println"], capture_output=True, text=True, timeout=120)
    plain, quiet, as_json = pie_run(), pie_run("-q"), pie_run("--json")
    assert plain.returncode == quiet.returncode == as_json.returncode == 0, plain.stderr
    assert "to the log: 2 + 2 = 4\na warning\n" in plain.stderr and plain.stdout == ""
    assert "to the log" not in quiet.stderr
    events = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert events[:2] == [{"log": "to the log: 2 + 2 = 4", "level": "info"}, {"log": "a warning", "level": "warn"}]
    assert events[2]["end"] == "finished" and events[2]["usage"]["host_calls"] > 0 and len(events) == 3


def test_text_stream_gives_the_whole_lists_text_a_token_at_a_time(server, probe, tokenizer):
    """inferlet::TextStream (a window of recent tokens per push) adds up to what detokenizing
    every token gives, holding a character split over byte tokens until it is whole, across
    several moves of its window (60+ tokens, window 16)."""
    text = ("Naïve café owners — 😀 say 你好, 世界! " * 3).strip()
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) > 60

    async def run():
        async with PieClient(server.ws, TOKEN) as client:
            instance = await client.launch(await client.upload(probe), ["textstream", ",".join(map(str, ids))])
            return [m async for m in instance], await instance.wait()

    messages, reason = asyncio.run(run())
    assert reason == "finished"
    out = json.loads(messages[0])
    assert out["finish"] == tokenizer.decode(ids, skip_special_tokens=False) == text
    held = 0
    for k in range(1, len(ids) + 1):
        streamed = "".join(out["pieces"][:k])
        whole = tokenizer.decode(ids[:k], skip_special_tokens=False)
        if whole.endswith("\ufffd"):
            held += 1
            assert whole.startswith(streamed)
        else:
            assert streamed == whole
    assert held > 0  # some characters did span tokens


def test_forked_context_continues_like_the_original(server, probe, hf_model, tokenizer):
    """Context::fork shares the full pages and copies the partial last one: both decode the
    same greedy tokens as HF transformers on the prompt."""
    prompt = "In a quiet harbor town, the old lighthouse keeper"  # not a whole number of pages

    async def run():
        async with PieClient(server.ws, TOKEN) as client:
            instance = await client.launch(await client.upload(probe), ["fork", prompt])
            return [m async for m in instance], await instance.wait()

    messages, reason = asyncio.run(run())
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    assert len(ids) % 16 != 0
    expected = tokenizer.decode(hf_greedy(hf_model, ids, 8), skip_special_tokens=False)
    assert reason == "finished" and messages == [expected, expected]
    resources = server.resources_once_pages_free()


def test_text_completion_sampling_arguments(server):
    """--temperature/--top-p/--seed reach the host sampler: a seed reproduces a draw."""
    args = ["--prompt", "Write one sentence about cats.", "--max-tokens", "12",
            "--temperature", "1.2", "--top-p", "0.95"]

    async def run(extra: list[str]) -> str:
        async with PieClient(server.ws, TOKEN) as client:
            instance = await client.launch("text_completion", args + extra)
            messages = [m async for m in instance]
            assert await instance.wait() == "finished"
            return messages[0]

    first, again = asyncio.run(run(["--seed", "7"])), asyncio.run(run(["--seed", "7"]))
    others = {asyncio.run(run(["--seed", str(s)])) for s in range(8, 12)}
    assert first == again
    assert len(others | {first}) > 1


def test_text_completion_turns_continue_one_context_as_hf_greedy(server, hf_model, tokenizer, chat_template):
    """`--turns 2 --objective latency`: a chat session. The second turn, sent to the
    instance, is answered on the same context (the first turn is not prefilled again) with
    exactly HF's greedy reply to the whole conversation rendered by the chat template."""
    from conftest import hf_greedy

    from pie.control.chat_template import render_chat

    first, second = "Name a fruit.", "And a vegetable?"

    async def run() -> tuple[list[str], str, dict]:
        async with PieClient(server.ws, TOKEN) as client:
            instance = await client.launch("text_completion", ["--prompt", first, "--max-tokens", "10",
                                                               "--turns", "2", "--objective", "latency"])
            replies = [(await instance.recv()).text]
            await instance.send(second)
            replies.append((await instance.recv()).text)
            return replies, await instance.wait(), instance.usage

    replies, reason, usage = asyncio.run(run())
    assert reason == "finished", replies
    eos = hf_model.config.eos_token_id
    conversation = [{"role": "user", "content": first}]
    ids = tokenizer.encode(render_chat(chat_template, conversation), add_special_tokens=False).ids
    assert replies[0] == tokenizer.decode(hf_greedy(hf_model, ids, 10, stop_at=eos), skip_special_tokens=False)
    conversation += [{"role": "assistant", "content": replies[0]}, {"role": "user", "content": second}]
    ids = tokenizer.encode(render_chat(chat_template, conversation), add_special_tokens=False).ids
    assert replies[1] == tokenizer.decode(hf_greedy(hf_model, ids, 10, stop_at=eos), skip_special_tokens=False)
    # Every token was forwarded once: the conversation plus the second reply, less the last.
    assert usage["forward_tokens"] <= len(ids) + 10


def test_backend_death_is_survived(tmp_path, expected):
    """kill -9 of the backend mid-generation: the running inferlet ends with the reason, /health
    says why, the server restarts the backend and then serves new launches correctly, with
    every page back in the pool."""
    victim = Server(tmp_path)
    try:
        async def long_generation() -> tuple[list[str], str]:
            async with PieClient(victim.ws, TOKEN) as client:
                instance = await client.launch("text_completion", ["--prompt", "Write a long story.",
                                                                   "--max-tokens", "4000"])
                # Decoding: the prefill and a few decode steps ran (of 4000: minutes of work).
                await until_async(lambda: sum(victim.scheduler()["calls"].get(k, 0) for k in ("forward", "pass")) >= 4,
                                  what="decoding under way")
                await until_async(lambda: victim.resources()["prefix_cache"]["cached_pages"] > 0,
                                  what="a page of the sequence kept by the prefix cache")
                os.kill(victim.backend_pid(), signal.SIGKILL)
                return [m async for m in instance], await instance.wait()

        messages, reason = asyncio.run(long_generation())
        assert messages == [] and "backend process exited" in reason and "restarted" in reason
        reasons = set()

        def healthy() -> bool:  # the restart loads the model again
            status, health = victim.get("/health")
            reasons.add(health.get("reason", ""))
            return status == 200

        until(healthy, what=lambda: f"/health back to 200 (seen: {reasons})", interval_s=0.5)
        assert victim.resources()["prefix_cache"]["cached_pages"] == 0  # cached pages died with it
        [(answer, end)] = asyncio.run(complete(victim.ws, [PROMPTS[0]]))
        assert end == "finished" and answer == [expected[PROMPTS[0]]]
        resources = victim.resources_once_pages_free()
    finally:
        victim.stop()


def test_http_reaches_allowlisted_hosts_only(server, probe, tool_server):
    async def run(url: str) -> list[str]:
        async with PieClient(server.ws, TOKEN) as client:
            instance = await client.launch(await client.upload(probe), ["http", url])
            return [m async for m in instance]

    [allowed] = asyncio.run(run(f"{tool_server.url}/tools"))
    assert allowed.startswith("200 ") and "calculator" in allowed
    [denied] = asyncio.run(run("http://example.invalid/secret"))
    assert denied.startswith("permission-denied") and "http_allowlist" in denied


def test_broadcast_reaches_subscribers(server, probe):
    async def run() -> tuple[list[str], str]:
        async with PieClient(server.ws, TOKEN) as client:
            digest = await client.upload(probe)
            listener = await client.launch(digest, ["subscribe", "news"])
            assert (await listener.recv()).text == "subscribed"
            talker = await client.launch(digest, ["broadcast", "news", "hello, swarm"])
            assert await talker.wait() == "finished"
            return [m async for m in listener], await listener.wait()

    messages, reason = asyncio.run(run())
    assert messages == ["hello, swarm"] and reason == "finished"


def test_fused_passes_bad_input_and_teardown_in_flight_leak_nothing(server, probe):
    """Bad fused passes get precise errors at the call and the instance goes on; an inferlet
    that traps, or is terminated, with host-side runs in flight leaks no page or embed: the
    batches in flight finish, their pages come back only then, the pools are full again."""
    async def run():
        async with PieClient(server.ws, TOKEN) as client:
            digest = await client.upload(probe)
            bad = await client.launch(digest, ["passes-bad"])
            bad_out = ([m async for m in bad], await bad.wait())
            trap = await client.launch(digest, ["passes-trap", "4"])
            trap_out = ([m async for m in trap], await trap.wait())
            hold = await client.launch(digest, ["passes-hold", "4"])
            assert (await hold.recv()).text == "running 4"
            await until_async(lambda: server.scheduler()["batches"].get("pass", 0) > 0, what="runs under way")
            await hold.terminate()
            return bad_out, trap_out, await hold.wait()

    (messages, reason), (_, trap_reason), hold_reason = asyncio.run(run())
    assert messages[:5] == [
        "forged: invalid-handle: kv page 4242 is not a live kv page of this instance",
        messages[1], "token: invalid-argument: input token 0 is 1000000, not below the vocabulary size 49152",
        "index: invalid-argument: output index 5 is out of range [0, 1) or repeated",
        "mask: invalid-argument: attention mask must be 1 bytes (packed bits of 1 x 1), got 3"]
    assert messages[5:7] == [
        "position: invalid-argument: position 1048576 is past the model's context length 8192 "
        "(positions 0..8191); the input is too long",
        "logprobs-of: invalid-argument: a logprobs-of id is not below the vocabulary size 49152"]
    assert messages[1].startswith("freed: invalid-handle: kv page") and messages[7].startswith("good: [")
    assert reason == "finished"
    assert trap_reason.startswith("trap: wasm `unreachable`") and hold_reason != "finished"
    until(lambda: server.scheduler()["queued"] == {}, what="nothing queued")
    until(lambda: (r := server.get("/stats")[1]["resources"])["kv_pages_free"] == r["kv_pages_total"]
          and r["embeds_free"] == r["embeds_total"], what="both pools full again")


def test_metrics_scraped_during_a_run(server):
    """GET /metrics on a real server, scraped before and while inferlets run: the calls,
    batches and ends it counts move with the work, the pools match /stats, and without an
    admin token it is refused (the tests' server has tokens)."""
    from prometheus_client.parser import text_string_to_metric_families

    def scrape(token: str = ADMIN) -> dict:
        request = urllib.request.Request(f"http://{server.address}/metrics", headers={"Authorization": f"Bearer {token}"})
        text = urllib.request.urlopen(request, timeout=30).read().decode()
        return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "replica"))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    before = scrape()
    running = subprocess.Popen([sys.executable, "-m", "pie.cli", "run", "text_completion", "--server",
                                f"http://{server.address}", "--token", TOKEN, "-q", "--", "--prompt", PROMPTS[0],
                                "--max-tokens", "16"], stdout=subprocess.PIPE, text=True)
    during = scrape()
    assert running.wait(timeout=120) == 0
    after = scrape()
    calls = lambda m: sum(v for (name, _), v in m.items() if name == "pie_scheduler_calls_total")
    assert before[("pie_backend_ready", ())] == 1
    assert calls(before) <= calls(during) <= calls(after) and calls(after) > calls(before)
    assert after[("pie_instances_ended_total", (("outcome", "finished"),))] >= \
        before.get(("pie_instances_ended_total", (("outcome", "finished"),)), 0) + 1
    assert after[("pie_scheduler_batch_size_count", ())] > before[("pie_scheduler_batch_size_count", ())]
    steps = after[("pie_backend_step_seconds_count", ())] - before[("pie_backend_step_seconds_count", ())]
    assert steps > 0 and after[("pie_backend_step_seconds_sum", ())] > before[("pie_backend_step_seconds_sum", ())]
    stats = server.get("/stats")[1]["resources"]
    assert after[("pie_kv_pages_total", ())] == stats["kv_pages_total"]
    with pytest.raises(urllib.error.HTTPError) as refused:
        scrape(TOKEN)  # a user's token, not an admin's
    assert refused.value.code == 401
