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
        encode([Pass(None, 1, 16, [5, 6], [0, 1], [], [], 0, [3], 0, None,  # type: ignore[arg-type]
                     [Output(1, sample=True, seed=9, logprob_ids=[4]), Output(0, dist_k=3)])]),
        P.StatsRequest(),
    ]
    assert set(P.REQUESTS) == {m.kind for m in samples}
    for i, message in enumerate(samples):
        assert P.decode_request(P.encode(i, message)) == (i, message)


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
