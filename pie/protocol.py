"""The wire protocol between the control layer and the inference layer (the backend).

This module is the only definition of these messages. Every ZeroMQ message is a single
msgpack frame `[request_id, kind, body]`; the reply to a request carries the same
`request_id` and `kind` (or kind `error` when the whole request was unusable). After each
batch the backend sends an unsolicited `[0, "idle", {}]` so the work-conserving scheduler
knows it may dispatch the next batch.

Batched messages are struct-of-arrays: one list per field, one entry per item. Variable-
length per-item data is flattened, with an `*_indptr` list of `n_items + 1` offsets (the
CSR layout FlashInfer uses). Replies carry `errors: {item_index: message}` — only failed
items appear; every other item of the batch was carried out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

import msgpack

PROTOCOL_VERSION = 6
IDLE_REQUEST_ID = 0


class Kind(StrEnum):
    HANDSHAKE = "handshake"
    EMBED_TEXT = "embed_text"
    FORWARD = "forward"
    NEXT_DIST = "next_dist"
    SAMPLE = "sample"
    COPY_KVPAGE = "copy_kvpage"
    MASK_KVPAGE = "mask_kvpage"
    SWAP_KVPAGE = "swap_kvpage"
    PASS = "pass"
    PASS_STEP = "pass_step"
    INTERRUPT = "interrupt"
    STATS = "stats"
    IDLE = "idle"
    ERROR = "error"


class ProtocolError(ValueError):
    """A frame that does not follow this protocol; the message says exactly how."""


@dataclass
class Message:
    """Base of every body; `kind` ties a dataclass to its envelope tag."""

    kind: ClassVar[Kind]

    def to_body(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


# --- handshake ---------------------------------------------------------------------------


@dataclass
class HandshakeRequest(Message):
    kind: ClassVar[Kind] = Kind.HANDSHAKE
    protocol_version: int = PROTOCOL_VERSION


@dataclass
class HandshakeReply(Message):
    """What the control layer needs to virtualize resources and tokenize on its own side."""

    kind: ClassVar[Kind] = Kind.HANDSHAKE
    protocol_version: int
    model_name: str
    traits: list[str]
    page_size: int
    num_kv_pages: int
    num_embeds: int
    vocab_size: int
    hidden_size: int
    max_batch_tokens: int
    tokenizer_json: str
    eos_token_ids: list[int]
    bos_token_id: int
    chat_template: str
    dtype: str
    device: str
    # The model's context length (config.json's max_position_embeddings): the most tokens,
    # prompt and completion together, one sequence may hold. 0: unknown (an older backend).
    context_length: int = 0
    # Pages of the host-memory tier (`swap_kvpage`); 0: none.
    num_host_kv_pages: int = 0


# --- batched handlers --------------------------------------------------------------------


@dataclass
class EmbedText(Message):
    """Item i: embed slot `embed_ids[i]` ← embedding of `token_ids[i]` at `positions[i]`."""

    kind: ClassVar[Kind] = Kind.EMBED_TEXT
    token_ids: list[int]
    positions: list[int]
    embed_ids: list[int]


@dataclass
class Forward(Message):
    """Item i runs its input embeds (new tokens, each with the position it was embedded at)
    through the model.

    Context: the tokens held by its input KV pages — every slot of each page except the
    last, of which only the first `kv_last_page_lens[i]` — minus slots whose mask bit is set.
    New tokens see that context and each other causally (in item order), unless
    `attention_masks[i]` is given: `numpy.packbits` of a row-major bool matrix
    [n_new, n_context_slots + n_new] (True = may attend), still ANDed with page masks.
    The new tokens' K/V are written consecutively into the output KV pages, starting at
    slot `out_kv_offsets[i]` of the first one (no output pages: nothing is written).
    Output embed j receives the final hidden state of new token `out_token_indices[j]`.
    """

    kind: ClassVar[Kind] = Kind.FORWARD
    kv_page_ids: list[int]
    kv_page_indptr: list[int]
    kv_last_page_lens: list[int]
    embed_ids: list[int]
    embed_indptr: list[int]
    out_kv_page_ids: list[int]
    out_kv_page_indptr: list[int]
    out_kv_offsets: list[int]
    out_embed_ids: list[int]
    out_token_indices: list[int]
    out_embed_indptr: list[int]
    attention_masks: list[bytes | None]


@dataclass
class NextDist(Message):
    """Item i: the `ks[i]` most likely next tokens after output embed `embed_ids[i]`."""

    kind: ClassVar[Kind] = Kind.NEXT_DIST
    embed_ids: list[int]
    ks: list[int]


@dataclass
class NextDistReply(Message):
    kind: ClassVar[Kind] = Kind.NEXT_DIST
    token_ids: list[list[int]]
    probs: list[list[float]]
    errors: dict[int, str] = field(default_factory=dict)


@dataclass
class Sample(Message):
    """Item i: one token drawn from output embed `embed_ids[i]`.

    temperature 0 is greedy; top_k 0 and top_p 1.0 disable those filters; seed -1 draws
    from the backend's generator, any other seed makes the draw reproducible (callers vary
    the seed per step). `allowed[i]`, if given and not None, restricts item i to a set of
    tokens (grammar-constrained decoding): a bitmask of ceil(vocab_size / 32) little-endian
    u32 words, bit t of word w = token 32 w + t allowed (llguidance's layout). An empty
    `allowed` list means no item is restricted.
    """

    kind: ClassVar[Kind] = Kind.SAMPLE
    embed_ids: list[int]
    temperatures: list[float]
    top_ks: list[int]
    top_ps: list[float]
    seeds: list[int]
    allowed: list[bytes | None] = field(default_factory=list)


@dataclass
class SampleReply(Message):
    kind: ClassVar[Kind] = Kind.SAMPLE
    token_ids: list[int]
    errors: dict[int, str] = field(default_factory=dict)


@dataclass
class CopyKvPage(Message):
    """Item i: copy `lengths[i]` token slots (K, V and mask bits) between pages."""

    kind: ClassVar[Kind] = Kind.COPY_KVPAGE
    src_page_ids: list[int]
    dst_page_ids: list[int]
    src_offsets: list[int]
    dst_offsets: list[int]
    lengths: list[int]


@dataclass
class SwapKvPage(Message):
    """Whole pages (K, V and mask bits) between the device pool and the host tier
    (`backend.num_host_kv_pages`): item i copies device page `device_page_ids[i]` to host
    page `host_page_ids[i]` where `to_host[i]`, else host to device. Items run in order."""

    kind: ClassVar[Kind] = Kind.SWAP_KVPAGE
    device_page_ids: list[int]
    host_page_ids: list[int]
    to_host: list[bool]


@dataclass
class MaskKvPage(Message):
    """Item i: set the per-slot mask bits of page `page_ids[i]` (True = hidden from attention)."""

    kind: ClassVar[Kind] = Kind.MASK_KVPAGE
    page_ids: list[int]
    masks: list[list[bool]]


@dataclass
class Passes(Message):
    """Fused passes: embedding, forward and every sampler of a batch in one request.

    Item i runs new tokens through the model exactly like a `Forward` item (context pages,
    output pages, optional attention mask) and computes what its output rows ask for.
    Numeric columns are packed little-endian arrays (`bytes`; element type in brackets),
    read with `numpy.frombuffer`, so a batch costs no per-element msgpack work.

    New tokens (T rows; item i owns rows `token_indptr[i]` to `token_indptr[i+1]`): row r
    is the embedding of `token_ids[r]` at `positions[r]`, or, where `embed_ids[r]` is not
    -1, that input embed's vector at the position it was embedded at.

    Output rows (R rows; item i owns rows `out_indptr[i]` to `out_indptr[i+1]`): row j reads
    the next-token distribution after new token `out_index[j]` of its item. `flags[j]` bit 0:
    draw a token (`temperature` 0 = greedy; `top_k` 0, `top_p` 1, `min_p` 0 disable those
    filters; `seed` -1 = the backend's generator); bit 1: the entropy. `dist_k[j]` > 0: the
    k most likely tokens. `logprob_ids[logprob_indptr[j]:logprob_indptr[j+1]]`: ids whose
    log-probability to return. Probabilities, log-probabilities and entropy are at
    temperature 1 after the bias and the allowed mask. `keep_embed[j]` != -1: the hidden
    state also goes to that embed. `allowed[j]` (an empty list: none) restricts row j as
    `Sample.allowed`. `bias_values[bias_indptr[j]:bias_indptr[j+1]]` are added to row j's
    logits at `bias_ids` (the same slice) before anything else; -inf bans a token
    (`bias_indptr` empty: no row has a bias; pie/control/logit_rules.py).
    """

    kind: ClassVar[Kind] = Kind.PASS
    token_ids: bytes  # [i32] T
    embed_ids: bytes  # [i32] T, -1 = a token row
    positions: bytes  # [i32] T
    token_indptr: bytes  # [i32] n + 1
    kv_page_ids: bytes  # [i32]
    kv_page_indptr: bytes  # [i32] n + 1
    kv_last_page_lens: bytes  # [i32] n
    out_kv_page_ids: bytes  # [i32]
    out_kv_page_indptr: bytes  # [i32] n + 1
    out_kv_offsets: bytes  # [i32] n
    attention_masks: list[bytes | None]  # n, or empty: no item has one
    out_indptr: bytes  # [i32] n + 1
    out_index: bytes  # [i32] R
    flags: bytes  # [u8] R
    temperature: bytes  # [f32] R
    top_k: bytes  # [i32] R
    top_p: bytes  # [f32] R
    min_p: bytes  # [f32] R
    seed: bytes  # [i64] R
    dist_k: bytes  # [i32] R
    keep_embed: bytes  # [i32] R
    logprob_ids: bytes  # [i32]
    logprob_indptr: bytes  # [i32] R + 1
    allowed: list[bytes | None] = field(default_factory=list)  # R, or empty
    bias_ids: bytes = b""  # [i32]
    bias_values: bytes = b""  # [f32], finite or -inf
    bias_indptr: bytes = b""  # [i32] R + 1, or empty
    # Whole KV pages copied before the forward and after it: [i32] pairs (src, dst), the
    # prefix cache's hits and the pages it keeps (pie/control/prefix_cache.py).
    copy_before: bytes = b""
    copy_after: bytes = b""
    # Steps the backend may take on its own after this one ([i32] n, or empty: none), each
    # item's next token its own draw at the next position and slot (docs/fused-pass.md §2.5).
    # An item goes on while it has steps left, its draw is not one of its `stop_ids`
    # (`stop_indptr` [i32] n + 1, or empty), and no request waits on the socket. Only an item
    # with one output row, at its last new token, that draws and asks for nothing else, whose
    # output slots continue its context, goes on; its pages must hold the steps' slots.
    ahead: bytes = b""
    stop_ids: bytes = b""
    stop_indptr: bytes = b""


FLAG_SAMPLE = 1
FLAG_ENTROPY = 2


@dataclass
class PassesReply(Message):
    """Per output row: `tokens` [i32] (-1 where not drawn or the item failed), `entropy`
    [f32] (NaN where not asked); `logprobs` [f32] parallel to the request's `logprob_ids`;
    `dist_ids` [i32] / `dist_probs` [f32] with `dist_indptr` [i32] R + 1. `errors` is keyed
    by item."""

    kind: ClassVar[Kind] = Kind.PASS
    tokens: bytes
    entropy: bytes
    logprobs: bytes
    dist_ids: bytes
    dist_probs: bytes
    dist_indptr: bytes
    errors: dict[int, str] = field(default_factory=dict)
    # True: items go on (`Passes.ahead`); `PassesStep` replies with this request id follow,
    # the last one `final`, and the idle signal only after it.
    more: bool = False


@dataclass
class PassesStep(Message):
    """One step the backend took on its own for a `Passes` request that replied `more`:
    `tokens` [i32] per item of the request (-1: the item did not step); `final`: no step
    follows (every item stopped, or a request waits). `errors`: items whose step failed."""

    kind: ClassVar[Kind] = Kind.PASS_STEP
    tokens: bytes
    final: bool
    errors: dict[int, str] = field(default_factory=dict)


@dataclass
class Interrupt(Message):
    """Ask the backend to end the steps it takes on its own (`Passes.ahead`) after the one it
    is computing: the control layer has other work for the next batch. Harmless when it takes
    none; the reply is empty."""

    kind: ClassVar[Kind] = Kind.INTERRUPT


@dataclass
class BatchReply(Message):
    """Reply of handlers that return nothing but per-item errors."""

    kind: ClassVar[Kind] = Kind.FORWARD
    errors: dict[int, str] = field(default_factory=dict)


@dataclass
class StatsRequest(Message):
    kind: ClassVar[Kind] = Kind.STATS


@dataclass
class StatsReply(Message):
    """Cumulative counters since the backend started (calls, items, tokens per handler)."""

    kind: ClassVar[Kind] = Kind.STATS
    counters: dict[str, int]


@dataclass
class Idle(Message):
    kind: ClassVar[Kind] = Kind.IDLE


@dataclass
class ErrorReply(Message):
    """The whole request was unusable (malformed frame, unknown kind, bad field lengths)."""

    kind: ClassVar[Kind] = Kind.ERROR
    message: str


_OUTER_TYPES: dict[str, tuple[type, ...]] = {
    "list": (list,),
    "dict": (dict,),
    "str": (str,),
    "int": (int,),
    "float": (int, float),
    "bytes": (bytes,),
    "bool": (bool,),
}

REQUESTS: dict[Kind, type[Message]] = {
    Kind.HANDSHAKE: HandshakeRequest,
    Kind.EMBED_TEXT: EmbedText,
    Kind.FORWARD: Forward,
    Kind.NEXT_DIST: NextDist,
    Kind.SAMPLE: Sample,
    Kind.COPY_KVPAGE: CopyKvPage,
    Kind.MASK_KVPAGE: MaskKvPage,
    Kind.SWAP_KVPAGE: SwapKvPage,
    Kind.PASS: Passes,
    Kind.INTERRUPT: Interrupt,
    Kind.STATS: StatsRequest,
}

REPLIES: dict[Kind, type[Message]] = {
    Kind.HANDSHAKE: HandshakeReply,
    Kind.EMBED_TEXT: BatchReply,
    Kind.FORWARD: BatchReply,
    Kind.NEXT_DIST: NextDistReply,
    Kind.SAMPLE: SampleReply,
    Kind.COPY_KVPAGE: BatchReply,
    Kind.MASK_KVPAGE: BatchReply,
    Kind.SWAP_KVPAGE: BatchReply,
    Kind.PASS: PassesReply,
    Kind.PASS_STEP: PassesStep,
    Kind.INTERRUPT: Interrupt,
    Kind.STATS: StatsReply,
    Kind.IDLE: Idle,
    Kind.ERROR: ErrorReply,
}


def encode(request_id: int, message: Message, kind: Kind | None = None) -> bytes:
    """One frame. `kind` overrides the message's own tag (BatchReply serves several kinds)."""
    return msgpack.packb([request_id, str(kind or message.kind), message.to_body()])


def decode_envelope(frame: bytes) -> tuple[int, Kind, dict[str, Any]]:
    """Split a frame into (request_id, kind, body) or raise ProtocolError saying why."""
    try:
        envelope = msgpack.unpackb(frame, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        detail = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise ProtocolError(f"frame is not valid msgpack ({detail})") from None
    if not (isinstance(envelope, list) and len(envelope) == 3):
        raise ProtocolError("frame must be a msgpack array [request_id, kind, body]")
    request_id, kind, body = envelope
    if not isinstance(request_id, int) or isinstance(request_id, bool):
        raise ProtocolError(f"request_id must be an integer, got {type(request_id).__name__}")
    if kind not in Kind.__members__.values():
        raise ProtocolError(f"unknown message kind {kind!r}")
    if not isinstance(body, dict):
        raise ProtocolError(f"body of {kind!r} must be a map, got {type(body).__name__}")
    return request_id, Kind(kind), body


def parse_body(cls: type[Message], body: dict[str, Any]) -> Message:
    """Build `cls` from a decoded body, checking field names and container types."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(body) - set(fields)
    if unknown:
        raise ProtocolError(f"{cls.kind}: unknown fields {sorted(map(str, unknown))}")
    missing = [
        name
        for name, f in fields.items()
        if name not in body
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ProtocolError(f"{cls.kind}: missing fields {missing}")
    for name, value in body.items():
        outer = fields[name].type.split("[", 1)[0].strip()  # annotations are strings here
        expected = _OUTER_TYPES.get(outer)
        if expected is not None and not isinstance(value, expected):
            raise ProtocolError(f"{cls.kind}.{name} must be {outer}, got {type(value).__name__}")
    return cls(**body)


def decode_request(frame: bytes) -> tuple[int, Message]:
    request_id, kind, body = decode_envelope(frame)
    if kind not in REQUESTS:
        raise ProtocolError(f"{kind} is not a request")
    return request_id, parse_body(REQUESTS[kind], body)


def decode_reply(frame: bytes) -> tuple[int, Kind, Message]:
    request_id, kind, body = decode_envelope(frame)
    return request_id, kind, parse_body(REPLIES[kind], body)
