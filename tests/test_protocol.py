from dataclasses import replace

import msgpack
import pytest

from pie import protocol as P
from pie.control.passes import Output, Pass, encode


def test_round_trip_of_every_request():
    samples = [
        P.HandshakeRequest(),
        P.EmbedText([1, 2], [0, 1], [5, 6]),
        P.Forward([1], [0, 1], [3], [4], [0, 1], [], [0, 0], [0], [7], [0], [0, 1], [None]),
        P.NextDist([1], [5]),
        P.Sample([1], [0.7], [40], [0.9], [3]),
        P.CopyKvPage([1], [2], [0], [0], [16]),
        P.MaskKvPage([1], [[True] * 16]),
        P.SwapKvPage([1, 2], [0, 1], [True, False]),
        replace(encode([Pass(None, 1, 16, [5, 6], [0, 1], [], [], 0, [3], 0, None,  # type: ignore[arg-type]
                             [Output(1, sample=True, seed=9, logprob_ids=[4]), Output(0, dist_k=3)])]),
                copy_before=bytes([7, 0, 0, 0, 3, 0, 0, 0]), copy_after=bytes([3, 0, 0, 0, 8, 0, 0, 0]),
                ahead=bytes([5, 0, 0, 0]), stop_ids=bytes([2, 0, 0, 0]), stop_indptr=bytes([0, 0, 0, 0, 1, 0, 0, 0])),
        P.Interrupt(),
        P.StatsRequest(),
    ]
    assert set(P.REQUESTS) == {m.kind for m in samples}
    for i, message in enumerate(samples):
        assert P.decode_request(P.encode(i, message)) == (i, message)


def test_round_trip_of_a_passes_reply():
    from array import array

    reply = P.PassesReply(tokens=array("i", [7, -1]).tobytes(), entropy=array("f", [float("nan"), 1.5]).tobytes(),
                          logprobs=array("f", [-0.25]).tobytes(), dist_ids=array("i", [3, 4]).tobytes(),
                          dist_probs=array("f", [0.5, 0.25]).tobytes(),
                          dist_indptr=array("i", [0, 0, 2]).tobytes(), errors={1: "bad page"})
    request_id, kind, back = P.decode_reply(P.encode(4, reply))
    assert (request_id, kind) == (4, P.Kind.PASS) and back.errors == {1: "bad page"}
    for name in ("tokens", "entropy", "logprobs", "dist_ids", "dist_probs", "dist_indptr"):
        assert getattr(back, name) == getattr(reply, name)
    with pytest.raises(P.ProtocolError, match="pass.flags must be bytes"):
        P.decode_request(msgpack.packb([1, "pass", {**_passes_body(), "flags": [1]}]))


def test_round_trip_of_a_step_taken_ahead():
    from array import array

    step = P.PassesStep(tokens=array("i", [7, -1]).tobytes(), final=True, errors={1: "bad"})
    assert P.decode_reply(P.encode(4, step)) == (4, P.Kind.PASS_STEP, step)
    reply = P.PassesReply(b"", b"", b"", b"", b"", b"", more=True)
    assert P.decode_reply(P.encode(4, reply))[2].more is True
    with pytest.raises(P.ProtocolError, match="pass_step.final must be bool"):
        P.decode_reply(msgpack.packb([4, "pass_step", {"tokens": b"", "final": 1}]))


def _passes_body() -> dict:
    return encode([Pass(None, 1, 16, [5], [0], [], [], 0, [3], 0, None,  # type: ignore[arg-type]
                        [Output(0, sample=True)])]).to_body()


def test_batch_reply_keeps_integer_error_keys():
    frame = P.encode(9, P.BatchReply({3: "bad page"}), P.Kind.COPY_KVPAGE)
    assert P.decode_reply(frame) == (9, P.Kind.COPY_KVPAGE, P.BatchReply({3: "bad page"}))


@pytest.mark.parametrize(
    "frame, message",
    [
        (b"\xc1\xc1", "not valid msgpack"),
        (msgpack.packb({"a": 1}), "must be a msgpack array"),
        (msgpack.packb([1, "forward"]), "must be a msgpack array"),
        (msgpack.packb(["x", "stats", {}]), "request_id must be an integer"),
        (msgpack.packb([1, "launch_rockets", {}]), "unknown message kind"),
        (msgpack.packb([1, "idle", {}]), "is not a request"),
        (msgpack.packb([1, "stats", []]), "body of 'stats' must be a map"),
        (msgpack.packb([1, "next_dist", {"embed_ids": [1]}]), r"missing fields \['ks'\]"),
        (msgpack.packb([1, "next_dist", {"embed_ids": [1], "ks": [1], "x": 2}]), "unknown fields"),
        (msgpack.packb([1, "next_dist", {"embed_ids": 1, "ks": [1]}]), "embed_ids must be list"),
    ],
)
def test_malformed_frames_are_precise_errors(frame, message):
    with pytest.raises(P.ProtocolError, match=message):
        P.decode_request(frame)
