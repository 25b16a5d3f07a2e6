"""Tenant isolation through a real `pie serve` with two users (issue 13, findings 1, 4, 5, 6):
exports, key-value store keys, topics and uploaded programs belong to their user; only a
`public:` name is shared, read-only for other users; persistent exports count against their
owner's KV quota; tokens are long enough to be secrets."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pie.client import PieClient
from pie.config import ConfigError, ServerConfig
from pie.control.quotas import fingerprint
from pie.server.rpc import RpcError

from conftest import hf_probe_continuation
from pie_server import TOKEN, Server, build, until

pytestmark = pytest.mark.anyio
OTHER = "isolation-user-b-0002"
PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, "
          "a goldsmith from Mainz, combined movable metal type with an oil-based ink and a screw press")
KV_QUOTA = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("isolation"), {
        "server": {"auth_tokens": [TOKEN, OTHER]},
        "quota.user": {"kv_pages": KV_QUOTA},
    })
    yield server
    server.stop()


@pytest.fixture(scope="module")
def probe() -> bytes:
    return build("probe")


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


async def run(client: PieClient, program: str, *args: str) -> tuple[list[str], str]:
    """Launch, collect every message, and the end reason."""
    instance = await client.launch(program, list(args))
    messages = [m async for m in instance]
    return messages, await instance.wait()


def held(server: Server, token: str) -> dict:
    """What `token`'s user holds, from its own /stats (which shows no other user)."""
    users = server.get("/stats", token)[1]["users"]
    assert set(users) <= {fingerprint(token)}, users
    return users.get(fingerprint(token), {})


def pools_full(server: Server) -> bool:
    """Once every page and embed is back (the bound only catches a leak or a hang)."""
    def full() -> bool:
        r = server.resources()
        return r["kv_pages_free"] == r["kv_pages_total"] and r["embeds_free"] == r["embeds_total"]

    return until(full, timeout_s=120, what=lambda: f"full pools (now: {server.resources()})", interval_s=0.1)


async def test_another_users_export_cannot_be_read_removed_or_squatted(server, probe, hf_model, tokenizer):
    """Finding 1: B imported A's export by name and decoded A's private continuation, could
    unexport it while A ran, and could take a name before A."""
    async with PieClient(server.ws, TOKEN) as alice, PieClient(server.ws, OTHER) as bob:
        program, _ = await alice.upload(probe), await bob.upload(probe)
        exporter = await alice.launch(program, ["export", "secret", PROMPT])
        private = (await exporter.recv()).text
        assert private == hf_probe_continuation(hf_model, tokenizer, PROMPT)  # the exporter's continuation
        # The same user reads its own export (the mechanism works) ...
        assert (await run(alice, program, "import", "secret", PROMPT))[0] == [private]
        # ... another user finds no such export, cannot remove it, and gets its own name.
        messages, reason = await run(bob, program, "import", "secret", PROMPT)
        assert messages == [] and "no export named 'secret'" in reason, reason
        assert (await run(bob, program, "unexport", "secret"))[0] == [
            "unexport: not-found: no export named 'secret'"]
        assert (await run(bob, program, "persist", "secret", "1"))[0] == ["persisted 1"]
        assert (await run(bob, program, "unexport", "secret"))[0] == ["unexport: ok"]
        # Another instance of the owner may not remove a running instance's export either.
        removed = (await run(alice, program, "unexport", "secret"))[0][0]
        assert removed.startswith("unexport: permission-denied") and "still running" in removed
        await exporter.send("done")
        assert await exporter.wait() == "finished"
    assert pools_full(server)


async def test_public_exports_are_shared_read_only(server, probe):
    async with PieClient(server.ws, TOKEN) as alice, PieClient(server.ws, OTHER) as bob:
        program, _ = await alice.upload(probe), await bob.upload(probe)
        exporter = await alice.launch(program, ["export", "public:intro", PROMPT])
        shared = (await exporter.recv()).text
        assert (await run(bob, program, "import", "public:intro", PROMPT))[0] == [shared]
        refused = (await run(bob, program, "unexport", "public:intro"))[0][0]
        assert refused.startswith("unexport: permission-denied") and "another user" in refused
        taken = (await run(bob, program, "persist", "public:intro", "1"))[0][0]
        assert taken.startswith("already-exists") and "another user owns" in taken
        await exporter.send("done")
        assert await exporter.wait() == "finished"
    assert pools_full(server)


async def test_persistent_exports_count_against_the_owners_kv_quota(server, probe):
    """Finding 4: a user pinned 1,024 pages in persistent exports while /stats showed 0, then
    held more pages on top."""
    async with PieClient(server.ws, TOKEN) as alice, PieClient(server.ws, OTHER) as bob:
        program, _ = await alice.upload(probe), await bob.upload(probe)
        assert (await run(alice, program, "persist", "pinned", "40"))[0] == ["persisted 40"]
        assert held(server, TOKEN)["kv_pages"] == 40 and held(server, TOKEN)["exports"] == 1
        holder = await alice.launch(program, ["hold", "30"])
        refused = (await holder.recv()).text
        assert refused.startswith("out-of-resources") and \
            f"holds 40 kv pages and asks for 30 more: over its quota quota.user.kv_pages = {KV_QUOTA}" in refused
        await holder.send("done")
        await holder.wait()
        over = (await run(alice, program, "persist", "more", "30"))[0][0]
        assert over.startswith("out-of-resources") and "quota.user.kv_pages" in over
        assert (await run(bob, program, "persist", "bobs", "40"))[0] == ["persisted 40"]  # his own
        for client, name in ((alice, "pinned"), (bob, "bobs")):
            assert (await run(client, program, "unexport", name))[0] == ["unexport: ok"]
    assert held(server, TOKEN)["kv_pages"] == 0 and held(server, OTHER)["kv_pages"] == 0
    assert pools_full(server)


async def test_key_value_store_and_topics_belong_to_their_user(server, probe):
    """Finding 5: B read and overwrote A's key and received A's topic."""
    async with PieClient(server.ws, TOKEN) as alice, PieClient(server.ws, OTHER) as bob:
        program, _ = await alice.upload(probe), await bob.upload(probe)
        assert (await run(alice, program, "kvs", "set", "k", "alice's secret"))[0] == ["set: ok"]
        assert (await run(bob, program, "kvs", "get", "k"))[0] == ["value: none"]
        assert (await run(bob, program, "kvs", "set", "k", "bob's"))[0] == ["set: ok"]
        assert (await run(alice, program, "kvs", "get", "k"))[0] == ["value: alice's secret"]
        assert (await run(alice, program, "kvs", "set", "public:motd", "hello"))[0] == ["set: ok"]
        assert (await run(bob, program, "kvs", "get", "public:motd"))[0] == ["value: hello"]
        refused = (await run(bob, program, "kvs", "set", "public:motd", "defaced"))[0][0]
        assert refused.startswith("set: permission-denied") and "another user" in refused
        await run(bob, program, "kvs", "delete", "public:motd")  # does nothing to alice's key
        assert (await run(bob, program, "kvs", "get", "public:motd"))[0] == ["value: hello"]
        for client, key in ((alice, "k"), (bob, "k"), (alice, "public:motd")):
            await run(client, program, "kvs", "delete", key)
        assert held(server, TOKEN)["kvs_bytes"] == 0 and held(server, OTHER)["kvs_bytes"] == 0

        # Topics: bob's broadcast on "news" reaches only bob's subscribers.
        subscriber = await alice.launch(program, ["subscribe", "news"])
        assert (await subscriber.recv()).text == "subscribed"
        assert (await run(bob, program, "broadcast", "news", "from bob"))[1] == "finished"
        assert (await run(alice, program, "broadcast", "news", "from alice"))[1] == "finished"
        assert (await subscriber.recv()).text == "from alice"
        assert await subscriber.wait() == "finished"
        # A public topic: any user may read it.
        listener = await bob.launch(program, ["subscribe", "public:feed"])
        assert (await listener.recv()).text == "subscribed"
        assert (await run(alice, program, "broadcast", "public:feed", "to all"))[1] == "finished"
        assert (await listener.recv()).text == "to all"
        assert await listener.wait() == "finished"
    assert pools_full(server)


async def test_uploaded_programs_belong_to_their_uploader(server):
    """Finding 5: B could launch A's uploaded program by its hash (and learn it exists)."""
    component = build("watermarking")
    async with PieClient(server.ws, TOKEN) as alice, PieClient(server.ws, OTHER) as bob:
        digest = await alice.upload(component)
        assert await alice.program_exists(digest)
        assert not await bob.program_exists(digest)  # answered like a missing program
        with pytest.raises(RpcError, match="unknown_program"):
            await bob.launch(digest, [])
        assert await bob.upload(component) == digest  # uploading it makes bob an owner too
        messages, reason = await run(bob, digest, "--detect", "a watermark")
        assert reason == "finished" and '"tokens"' in messages[0]


@pytest.mark.parametrize("tokens", [[""], ["   "], ["short"], ["x" * 15], [" " + "x" * 20],
                                    ["a" * 16, "a" * 16]])
def test_weak_tokens_are_refused(tokens):
    """Finding 6: `auth_tokens = [""]` was accepted and let anyone in, defeating the
    non-loopback guard; one-character tokens were accepted."""
    with pytest.raises(ConfigError, match="at least 16 characters|appears twice"):
        ServerConfig(host="0.0.0.0", auth_tokens=tokens)
    with pytest.raises(ConfigError):
        ServerConfig(admin_tokens=tokens)
    assert ServerConfig(host="0.0.0.0", auth_tokens=["a" * 16]).tokens == ["a" * 16]


def test_pie_token_makes_a_usable_token():
    out = subprocess.run([sys.executable, "-m", "pie.cli", "token"], capture_output=True, text=True,
                         check=True).stdout
    token = out.split("token:")[1].split()[0]
    assert ServerConfig(host="0.0.0.0", auth_tokens=[token])
    assert f"fingerprint: {fingerprint(token)}" in out


def test_serve_warns_when_users_share_a_server_without_fair_share_quotas():
    from pie import cli
    from pie.config import PieConfig, UserQuota

    def warning(**quota) -> str:
        config = PieConfig()
        config.server = ServerConfig(auth_tokens=["a" * 16, "b" * 16])
        config.quota.user = UserQuota(**quota)
        with cli.console.capture() as captured:
            cli._warn_shared_without_quotas(config)
        return captured.get()

    assert "quota.user.kv_pages or quota.user.instances" in warning()
    assert "quota.user.instances" in warning(kv_pages=512) and "kv_pages" not in warning(kv_pages=512)
    assert warning(kv_pages=512, instances=64) == ""
