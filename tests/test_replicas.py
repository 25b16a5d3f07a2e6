"""Several backend replicas behind one control layer (`backend.replicas`, issue 22 item 1):
placement, statistics merged over replicas, and one real `pie serve --replicas 2` whose
replicas each serve HF's greedy output, keep a launch near its cached prefix, and survive
one of them being killed."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from pie import protocol as P
from pie.client import PieClient
from pie.control.backend_link import BackendError
from pie.control.controller import merged
from pie.control.placement import BLOCK_BYTES, Placement, PrefixMemory, blocks
from pie.server.backends import common_handshake, cpu_shares
from tests.pie_server import ADMIN, TOKEN, Server, base_config, to_toml, until, until_async


@dataclass
class FakeReplica:
    index: int
    live: int = 0
    serving: bool = True


def test_blocks_name_their_whole_prefix_per_program():
    a = blocks("p", ["--prompt", "x" * 200])
    assert len(a) == 4  # 209 bytes: 3 whole blocks and a part
    assert blocks("p", ["--prompt", "x" * 200 + "y"])[:3] == a[:3]
    assert blocks("p", ["--prompt", "z" + "x" * 199])[0] != a[0]
    assert blocks("q", ["--prompt", "x" * 200])[0] != a[0]  # another program's prompt is not its cache
    memory = PrefixMemory(capacity=3)
    memory.remember(a)
    assert memory.matched(a) == 3  # the 3 newest keys are kept: the tail block went first
    memory.forget()
    assert memory.matched(a) == 0


def test_least_loaded_placement_and_replicas_that_do_not_serve():
    replicas = [FakeReplica(0, live=3), FakeReplica(1, live=1), FakeReplica(2, live=1)]
    placement = Placement("least-loaded", 4, 3)
    assert placement.choose(replicas, "p", ["a"]).index == 1  # fewest, then the lowest index
    replicas[1].serving = False
    assert placement.choose(replicas, "p", ["a"]).index == 2
    for r in replicas:
        r.serving = False
    assert placement.choose(replicas, "p", ["a"]) is None


def test_cache_aware_placement_follows_the_prefix_until_load_differs_too_much():
    replicas = [FakeReplica(0), FakeReplica(1)]
    placement = Placement("cache-aware", 2, 2)
    system = ["--message", "system", "s" * (4 * BLOCK_BYTES)]
    first = placement.choose(replicas, "p", [*system, "--message", "user", "hi"])
    first.live += 1
    # A launch with the same long system prompt goes where the first one went ...
    second = placement.choose(replicas, "p", [*system, "--message", "user", "bye"])
    assert second is first
    second.live += 1
    # ... one with another prompt to the least loaded
    other = placement.choose(replicas, "p", ["--prompt", "something else"])
    assert other is not first
    # Past control.placement_imbalance live instances apart, load decides.
    first.live = 2 + other.live + 1
    assert placement.choose(replicas, "p", [*system, "--message", "user", "again"]) is other
    # That launch taught `other` the prefix too; a restarted replica's cache is empty, and
    # its remembered prefixes go with it.
    first.live = other.live = 0
    placement.forget(first.index)
    assert placement.choose(replicas, "p", [*system, "x"]) is other
    placement.forget(other.index)
    assert placement.choose(replicas, "p", [*system, "y"]).index == 0  # no match: least loaded, lowest index


def test_statistics_of_replicas_merge_into_one():
    a = {"calls": {"pass": 6}, "batches": {"pass": 3}, "mean_batch_size": 2.0, "mean_wait_ms": 1.0,
         "max_wait_ms": 5.0, "queued": {}, "steps": 3}
    b = {"calls": {"pass": 2, "copy_kvpage": 2}, "batches": {"pass": 1, "copy_kvpage": 1}, "mean_batch_size": 2.0,
         "mean_wait_ms": 4.0, "max_wait_ms": 2.0, "queued": {"pass": 1}, "steps": 1}
    m = merged([a, b])
    assert m["calls"] == {"pass": 8, "copy_kvpage": 2} and m["queued"] == {"pass": 1} and m["steps"] == 4
    assert m["max_wait_ms"] == 5.0 and m["mean_batch_size"] == 10 / 5
    assert m["mean_wait_ms"] == pytest.approx((6 * 1.0 + 4 * 4.0) / 10)
    cache = merged([{"lookup_tokens": 10, "hit_tokens": 5, "hit_rate": 0.5, "policy": "x"},
                    {"lookup_tokens": 30, "hit_tokens": 5, "hit_rate": 1 / 6, "policy": "x"}])
    assert cache == {"lookup_tokens": 40, "hit_tokens": 10, "hit_rate": 0.25, "policy": "x"}
    assert merged([a]) is a


def test_replicas_must_agree_and_pinning_needs_the_cores():
    hello = P.HandshakeReply(
        protocol_version=P.PROTOCOL_VERSION, model_name="m", traits=[], page_size=16, num_kv_pages=8,
        num_embeds=100, vocab_size=10, hidden_size=4, max_batch_tokens=64, tokenizer_json="{}",
        eos_token_ids=[2], bos_token_id=1, chat_template="", dtype="float32", device="cpu")
    assert common_handshake([hello, hello]) is hello
    other = P.HandshakeReply(**{**dataclasses.asdict(hello), "num_kv_pages": 16})
    with pytest.raises(BackendError, match="replica 1 differs from replica 0 in num_kv_pages"):
        common_handshake([hello, other])
    cores = sorted(os.sched_getaffinity(0))
    assert cpu_shares(len(cores), 1) == [[c] for c in cores]
    assert cpu_shares(1, len(cores)) == [cores]
    with pytest.raises(BackendError, match=f"needs {len(cores) + 1} cores"):
        cpu_shares(len(cores) + 1, 1)


# --- a real server with two replicas ------------------------------------------------------------

STORY = ["--prompt", "Write a long story about a dragon.", "--max-tokens", "4000"]


def replicas(server: Server) -> list[dict]:
    return server.get("/stats", ADMIN)[1]["replicas"]


def backend_pid(server: Server, replica: int) -> int:
    endpoint = replicas(server)[replica]["endpoint"]
    return next(pid for pid in server.backend_pids() if endpoint in server.cmdline(pid))


async def generate(server: Server, arguments: list[str]) -> tuple[list[str], str]:
    async with PieClient(server.ws, TOKEN) as client:
        instance = await client.launch("text_completion", arguments)
        return [m async for m in instance], await instance.wait()


def hf_greedy_at_once(server: Server, prompts: list[str], hf_chat, tokens: int = 16) -> None:
    """One text_completion per prompt, launched together: each finishes with HF's greedy text."""
    async def all_of_them() -> list[tuple[list[str], str]]:
        return await asyncio.gather(*(generate(server, ["--prompt", p, "--max-tokens", str(tokens)])
                                      for p in prompts))

    for (messages, reason), prompt in zip(asyncio.run(all_of_them()), prompts):
        assert reason == "finished" and messages == [hf_chat(prompt, tokens)]


def test_two_replicas_place_serve_and_survive_one_dying(tmp_path, hf_chat):
    server = Server(tmp_path, {"backend": {"replicas": 2}})
    try:
        status, health = server.get("/health")
        assert status == 200 and [r["status"] for r in health["replicas"]] == ["ok", "ok"]
        prompts = ["What is the capital of France?", "Name three colors.", "What is 2 + 2?"]

        hf_greedy_at_once(server, prompts, hf_chat)
        launched = [r["launched"] for r in replicas(server)]
        assert min(launched) >= 1 and sum(launched) == 3  # both replicas took launches

        # The same prompt again runs where its pages are cached: that replica's prefix cache hits.
        before = replicas(server)
        [(messages, reason)] = [asyncio.run(generate(server, ["--prompt", prompts[0], "--max-tokens", "16"]))]
        after = replicas(server)
        (where,) = [i for i in range(2) if after[i]["launched"] > before[i]["launched"]]
        assert messages == [hf_chat(prompts[0], 16)]
        assert after[where]["resources"]["prefix_cache"]["hit_tokens"] > \
            before[where]["resources"]["prefix_cache"]["hit_tokens"]

        async def one_dies() -> tuple[tuple[list[str], str], tuple[list[str], str], int]:
            async with PieClient(server.ws, TOKEN) as client:
                doomed = await client.launch("text_completion", STORY)
                placed = await until_async(lambda: [r["replica"] for r in replicas(server) if r["instances"]],
                                           what="the first instance placed")
                victim = placed[0]
                survivor = await client.launch("text_completion", ["--prompt", prompts[1], "--max-tokens", "96"])
                await until_async(lambda: all(r["instances"] == 1 for r in replicas(server)),
                                  what="one instance on each replica")
                await until_async(lambda: replicas(server)[victim]["scheduler"]["calls"].get("pass", 0)
                                  > before[victim]["scheduler"]["calls"].get("pass", 0) + 2, what="decoding")
                os.kill(backend_pid(server, victim), signal.SIGKILL)

                async def collect(instance):
                    return [m async for m in instance], await instance.wait()

                return await collect(doomed), await collect(survivor), victim

        (lost, lost_reason), (kept, kept_reason), victim = asyncio.run(one_dies())
        assert lost == [] and f"backend replica {victim} process exited" in lost_reason
        assert "restarted" in lost_reason
        assert kept_reason == "finished" and kept == [hf_chat(prompts[1], 96)]

        def back() -> bool:
            status, health = server.get("/health")
            return status == 200 and health["status"] == "ok"

        until(back, what="the killed replica restarted", interval_s=0.5)
        assert all(r["status"] == "ok" for r in replicas(server))
        [(messages, reason)] = [asyncio.run(generate(server, ["--prompt", prompts[2], "--max-tokens", "16"]))]
        assert reason == "finished" and messages == [hf_chat(prompts[2], 16)]
        def pools_full() -> list[dict] | None:
            rs = replicas(server)
            return rs if all(r["resources"]["kv_pages_free"] == r["resources"]["kv_pages_total"]
                             for r in rs) else None

        for r in until(pools_full, what="every page back in both pools"):
            assert r["resources"]["embeds_free"] == r["resources"]["embeds_total"]
    finally:
        server.stop()


# --- remote backends: the link's security (pie/transport.py) ------------------------------------

SECRET = b"a-shared-secret-of-32-bytes-0001"


def test_endpoints_off_loopback_need_a_secret(tmp_path, monkeypatch):
    from pie.transport import TransportError, check_endpoint, is_loopback, load_secret

    assert is_loopback("ipc:///tmp/x.sock") and is_loopback("tcp://127.0.0.1:5555") and is_loopback("tcp://[::1]:5")
    assert not is_loopback("tcp://0.0.0.0:5555") and not is_loopback("tcp://*:5555")
    assert not is_loopback("tcp://backend.example:5555")
    check_endpoint("tcp://127.0.0.1:5555", None)
    with pytest.raises(TransportError, match="reachable from other machines: set backend.secret_file"):
        check_endpoint("tcp://0.0.0.0:5555", None)
    check_endpoint("tcp://0.0.0.0:5555", SECRET)
    monkeypatch.delenv("PIE_BACKEND_SECRET", raising=False)
    assert load_secret("") is None
    (tmp_path / "secret").write_bytes(SECRET + b"\n")
    assert load_secret(str(tmp_path / "secret")) == SECRET
    (tmp_path / "short").write_text("short")
    with pytest.raises(TransportError, match="at least 16 bytes"):
        load_secret(str(tmp_path / "short"))
    with pytest.raises(TransportError, match="cannot be read"):
        load_secret(str(tmp_path / "missing"))
    monkeypatch.setenv("PIE_BACKEND_SECRET", "from-the-environment-0001")
    assert load_secret(str(tmp_path / "secret")) == b"from-the-environment-0001"


class FakeRemote:
    """A ROUTER socket on loopback tcp answering every request with `answer(payload)`, with
    CURVE when it has a secret (the backend's transport, without a model)."""

    def __init__(self, secret: bytes | None, answer):
        import threading

        import zmq

        from pie.transport import secure_server

        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.auth = secure_server(self.socket, self.context, secret) if secret else None
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.answer, self.running = answer, True
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.running:
            if self.socket.poll(50):
                *envelope, payload = self.socket.recv_multipart()
                self.socket.send_multipart([*envelope, self.answer(payload)])

    def close(self) -> None:
        self.running = False
        self.thread.join(5)
        self.socket.close()
        if self.auth:
            self.auth.stop()
        self.context.term()


def handshake_reply(payload: bytes) -> bytes:
    request_id, _, _ = P.decode_envelope(payload)
    return P.encode(request_id, P.HandshakeReply(
        protocol_version=P.PROTOCOL_VERSION, model_name="m", traits=[], page_size=16, num_kv_pages=8,
        num_embeds=100, vocab_size=10, hidden_size=4, max_batch_tokens=64, tokenizer_json="{}",
        eos_token_ids=[2], bos_token_id=1, chat_template="", dtype="float32", device="cpu"))


@pytest.mark.parametrize("case", ["same secret", "wrong secret", "no client secret", "garbage"])
def test_the_link_authenticates_with_the_shared_secret(case):
    from pie.control.backend_link import BackendLink

    remote = FakeRemote(None if case == "garbage" else SECRET,
                        (lambda payload: b"\x93not a reply") if case == "garbage" else handshake_reply)
    client_secret = {"same secret": SECRET, "wrong secret": b"another-secret-of-32-bytes-00002",
                     "no client secret": None, "garbage": None}[case]
    link = BackendLink(remote.endpoint, secret=client_secret)
    try:
        request = link.send(P.HandshakeRequest())
        if case == "same secret":
            assert link.wait(request, timeout_s=30).model_name == "m"
            return
        expected = {"wrong secret": "handshake with .* failed: the two ends' backend secrets differ",
                    "no client secret": "handshake with .* failed: the two ends' backend secrets differ, or one has none",
                    "garbage": "sent a malformed reply"}[case]
        with pytest.raises(BackendError, match=expected):
            link.wait(request, timeout_s=30)
    finally:
        link.close()
        remote.close()


class RemoteBackend:
    """`pie backend --endpoint tcp://127.0.0.1:PORT` run by hand, as on another machine."""

    def __init__(self, tmp: Path, port: int, secret: bytes):
        import subprocess
        import sys

        config = tmp / "remote.toml"  # the test server's backend table: replicas must be alike
        config.write_text(to_toml({"backend": base_config()["backend"]}))
        env = {**os.environ, "PIE_BACKEND_SECRET": secret.decode()}
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.process = subprocess.Popen([sys.executable, "-m", "pie.cli", "backend", "--endpoint", self.endpoint,
                                         "--config", str(config)], env=env)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(30)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_remote_replica_with_a_wrong_secret_waits_then_serves_then_is_lost(tmp_path, hf_chat, monkeypatch):
    """A local replica beside a remote one over tcp with CURVE: a wrong secret leaves the
    server serving on the local one (degraded, saying why); the remote one, restarted with
    the right secret, is found and serves greedy output equal to HF's; killed, the
    instances on it end, and the server goes on."""
    port = free_port()
    remote = RemoteBackend(tmp_path, port, b"the-wrong-secret-for-this-0001")
    monkeypatch.setenv("PIE_BACKEND_SECRET", SECRET.decode())
    server = None
    try:
        server = Server(tmp_path, {"backend": {"replicas": 1, "endpoints": [remote.endpoint],
                                               "remote_timeout_s": 5.0}, "control": {"placement": "least-loaded"}})
        status, health = server.get("/health")
        assert status == 200 and health["status"] == "degraded"  # serving on the local replica
        # (while the remote one loads, the reason is that it does not answer; then why)
        until(lambda: "backend secrets differ" in server.get("/health")[1]["replicas"][1]["reason"],
              what="the wrong secret named", interval_s=0.5)
        remote.kill()
        remote = RemoteBackend(tmp_path, port, SECRET)
        until(lambda: server.get("/health")[1]["status"] == "ok", interval_s=0.5,
              what=lambda: f"the remote replica found: {server.get('/health')[1]}")
        prompts = ["Name three colors.", "What is 2 + 2?"]

        hf_greedy_at_once(server, prompts, hf_chat)
        assert [r["launched"] for r in replicas(server)] == [1, 1]

        async def lost() -> str:
            async with PieClient(server.ws, TOKEN) as client:
                await client.launch("text_completion", STORY)  # on replica 0 (least loaded, lowest index)
                on_remote = await client.launch("text_completion", STORY)
                await until_async(lambda: replicas(server)[1]["instances"] == 1, what="one on the remote")
                remote.kill()
                return await on_remote.wait()

        reason = asyncio.run(lost())
        assert reason.startswith("error: backend replica 1 (tcp://") and " is lost: " in reason
        status, health = server.get("/health")
        assert status == 200 and health["status"] == "degraded"
    finally:
        if server is not None:
            server.stop()
        remote.kill()


@pytest.mark.slow  # starts a Ray cluster (~25 s); the spawned and tcp replicas above are the fast e2e path
def test_replicas_as_ray_actors_serve_and_come_back(tmp_path, hf_chat):
    """`backend.ray = "local"`: two replicas as actors of a local Ray cluster, attached over
    tcp with a secret made for the run; a replica's backend killed comes back (its actor
    restarts it) and serves again, while the instance that ran on it ends saying why."""
    pytest.importorskip("ray", reason="Ray is a dev extra (pip install -e '.[dev]')")
    import subprocess

    server = Server(tmp_path, {"backend": {"replicas": 2, "ray": "local", "remote_timeout_s": 10.0},
                               "control": {"placement": "least-loaded"}})
    try:
        status, health = server.get("/health")
        assert status == 200 and [r["status"] for r in health["replicas"]] == ["ok", "ok"]
        assert all(r["endpoint"].startswith("tcp://") for r in replicas(server))
        prompts = ["Name three colors.", "What is 2 + 2?"]

        hf_greedy_at_once(server, prompts, hf_chat)
        assert [r["launched"] for r in replicas(server)] == [1, 1]

        async def lost() -> str:
            async with PieClient(server.ws, TOKEN) as client:
                doomed = await client.launch("text_completion", STORY)
                await until_async(lambda: replicas(server)[0]["instances"] == 1, what="placed on replica 0")
                port = replicas(server)[0]["endpoint"].rsplit(":", 1)[1]
                pids = subprocess.run(["pgrep", "-f", f"pie.cli backend .*tcp://0.0.0.0:{port}"],
                                      capture_output=True, text=True).stdout.split()
                os.kill(int(pids[0]), signal.SIGKILL)
                return await doomed.wait()

        reason = asyncio.run(lost())
        assert reason.startswith("error: backend replica 0 (tcp://") and "connection to the backend" in reason
        until(lambda: server.get("/health")[1]["status"] == "ok", what="the actor's backend back", interval_s=0.5)
        [(messages, reason)] = [asyncio.run(generate(server, ["--prompt", prompts[0], "--max-tokens", "16"]))]
        assert reason == "finished" and messages == [hf_chat(prompts[0], 16)]
    finally:
        server.stop()


def test_a_backend_that_answers_garbage_fails_the_batch_not_the_scheduler():
    """A peer whose frames are no replies: the batch in flight fails with the reason, and the
    scheduler goes on (the next call fails the same way instead of hanging)."""
    from pie.config import ControlConfig
    from pie.control.errors import HostError
    from pie.control.scheduler import Scheduler
    from tests.test_control import _wait, sample

    remote = FakeRemote(None, lambda payload: b"\x93not a reply")
    scheduler = Scheduler(remote.endpoint, ControlConfig(), max_batch_tokens=64)
    try:
        queue = scheduler.create_queue("i")
        for _ in range(2):
            future = scheduler.submit(sample(queue))
            assert _wait(future)
            with pytest.raises(HostError, match=f"the backend at {remote.endpoint} sent a malformed reply"):
                future.result()
        assert scheduler.channel.thread.is_alive()
    finally:
        scheduler.stop()
        remote.close()


def test_a_remote_backend_that_never_answers_is_named():
    from pie.server.backends import reach

    port = free_port()  # nothing listens there
    reason = reach(f"tcp://127.0.0.1:{port}", None, 1.0)
    assert reason.startswith(f"no answer from tcp://127.0.0.1:{port} in 1 s")


@pytest.mark.parametrize("case", ["unreachable ray", "open backend"])
def test_what_cannot_be_served_safely_is_refused_at_start(tmp_path, monkeypatch, case):
    """An unreachable Ray cluster, a backend asked to listen off loopback without a secret:
    a precise error and exit status 1 at once (no model loaded, nothing left running)."""
    import subprocess
    import sys

    monkeypatch.delenv("PIE_BACKEND_SECRET", raising=False)
    port = free_port()
    if case == "unreachable ray":
        (tmp_path / "pie.toml").write_text(f'[backend]\nray = "127.0.0.1:{port}"\n')
        argv = ["serve", "--port", "0", "--config", str(tmp_path / "pie.toml")]
        expected = f"cannot reach the Ray cluster at 127.0.0.1:{port}"
    else:
        argv = ["backend", "--endpoint", f"tcp://0.0.0.0:{port}"]
        expected = "reachable from other machines: set backend.secret_file"
    done = subprocess.run([sys.executable, "-m", "pie.cli", *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and expected in " ".join((done.stdout + done.stderr).split()), done.stderr[-2000:]
