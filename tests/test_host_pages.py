"""The host-memory tier of the KV cache (pie/backend/host_pages.py, `swap_kvpage`), through
the engine with the default model in fp32."""

from __future__ import annotations

import pytest
from conftest import run_sampling_passes, sampling_pass

from pie import protocol as P
from pie.backend.engine import Engine
from pie.config import BackendConfig, ConfigError

PS = 16


@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    return Engine(model_dir, BackendConfig(dtype="float32", num_kv_pages=16, num_embeds=16,
                                           num_host_kv_pages=4, page_size=PS))


def decode(engine: Engine, prompt: list[int], pages: list[int], steps: int,
           between=None) -> list[int]:
    """Greedy tokens: the prompt on `pages`, then `steps` steps; `between(pages)` may move
    the sequence after the prompt and return the pages it now lives on."""
    (token,) = run_sampling_passes(engine, [sampling_pass(prompt, 0, pages, PS)])
    if between is not None:
        pages = between(pages)
    out = [token]
    for _ in range(steps):
        (token,) = run_sampling_passes(engine, [sampling_pass([out[-1]], len(prompt) + len(out) - 1, pages, PS)])
        out.append(token)
    return out


def swap(engine: Engine, device: list[int], host: list[int], to_host: list[bool]) -> dict[int, str]:
    return engine.handle(P.SwapKvPage(device, host, to_host)).errors


def test_a_sequence_swapped_out_and_back_elsewhere_decodes_as_if_never_moved(engine):
    prompt = [504, 3575, 282, 4649, 314] * 7 + [42] * 5  # 40 tokens: 3 pages
    want = decode(engine, prompt, [0, 1, 2, 3], 8)

    def move(pages: list[int]) -> list[int]:
        assert swap(engine, pages[:3], [0, 1, 2], [True] * 3) == {}
        run_sampling_passes(engine, [sampling_pass(list(range(300, 348)), 0, pages[:3], PS)])  # reuse them
        assert swap(engine, [8, 9, 10], [0, 1, 2], [False] * 3) == {}
        return [8, 9, 10, 11]

    assert decode(engine, prompt, [4, 5, 6, 7], 8, between=move) == want
    assert engine.handshake(P.HandshakeRequest()).num_host_kv_pages == 4


def test_items_run_in_order_and_bad_ones_fail_alone(engine):
    prompt = list(range(1000, 1016))
    want = decode(engine, prompt, [0, 1], 4)

    def round_trip(pages: list[int]) -> list[int]:
        # out to host 3, then (same request) page 0 overwritten from host 2 and restored from host 3
        errors = swap(engine, [0, 0, 0, 99, 0], [3, 2, 3, 0, 7], [True, False, False, True, "x"])
        assert set(errors) == {3, 4}
        assert "device 99 of [0, 16)" in errors[3] and "to_host must be a boolean" in errors[4]
        return pages

    assert decode(engine, prompt, [0, 1], 4, between=round_trip) == want


def test_without_a_host_tier_every_item_fails_with_the_reason(model_dir):
    bare = Engine(model_dir, BackendConfig(dtype="float32", num_kv_pages=4, num_embeds=4, num_host_kv_pages=0))
    errors = swap(bare, [0], [0], [True])
    assert errors == {0: "this backend has no host tier (backend.num_host_kv_pages = 0)"}
    assert bare.handshake(P.HandshakeRequest()).num_host_kv_pages == 0
    with pytest.raises(ConfigError, match="num_host_kv_pages must be >= 0"):
        BackendConfig(num_host_kv_pages=-1)


def test_an_emulated_link_holds_the_swap_reply_while_the_backend_goes_on(model_dir, tmp_path):
    """backend.swap_gbps: a swap's reply waits for the emulated link (here 1 MB/s: ~0.35 s a
    page); a request sent after it is answered first, and the swap's reply comes after."""
    import threading

    import zmq

    from pie.backend.server import BackendServer

    engine = Engine(model_dir, BackendConfig(dtype="float32", num_kv_pages=4, num_embeds=4,
                                             num_host_kv_pages=2, swap_gbps=0.001))
    server = BackendServer(engine, f"ipc://{tmp_path}/b.sock")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    context = zmq.Context()
    peer = context.socket(zmq.DEALER)
    peer.connect(f"ipc://{tmp_path}/b.sock")
    try:
        peer.send(P.encode(1, P.SwapKvPage([0], [0], [True])))
        peer.send(P.encode(2, P.HandshakeRequest()))
        replies = []
        while len(replies) < 2:
            assert peer.poll(30_000), "no reply"
            request_id, kind, reply = P.decode_reply(peer.recv())
            if kind is not P.Kind.IDLE:
                replies.append((request_id, kind))
        assert replies == [(2, P.Kind.HANDSHAKE), (1, P.Kind.SWAP_KVPAGE)]
    finally:
        server.stop()
        thread.join(5)
        peer.close()
        context.term()
