"""A batch of commands to one protocol message (`build_batch`), and the reply back to each
command's future (`resolve_batch`); also how a command that never ran, or a marker, settles.
No I/O: the scheduler sends and receives."""

from __future__ import annotations

from typing import Any

from pie import protocol as P
from pie.control.command import Command
from pie.control.errors import ErrorKind, HostError
from pie.control.passes import encode, fail


def build_batch(kind: str, batch: list[Command], ahead_steps: int = 0) -> P.Message:
    """The batch as its protocol message; fused passes' runs may go on for up to
    `ahead_steps` steps in the backend (`Pass.ahead`)."""
    if kind == P.Kind.PASS:
        return encode(batch, ahead_steps)  # type: ignore[arg-type]
    items = [c.item for c in batch]
    if kind == P.Kind.EMBED_TEXT:
        return P.EmbedText(*(sum((i[f] for i in items), []) for f in ("token_ids", "positions", "embed_ids")))
    if kind == P.Kind.FORWARD:
        msg = P.Forward([], [0], [], [], [0], [], [0], [], [], [], [0], [])
        for i in items:
            msg.kv_page_ids += i["kv_pages"]
            msg.kv_page_indptr.append(len(msg.kv_page_ids))
            msg.kv_last_page_lens.append(i["last_len"])
            msg.embed_ids += i["embeds"]
            msg.embed_indptr.append(len(msg.embed_ids))
            msg.out_kv_page_ids += i["out_pages"]
            msg.out_kv_page_indptr.append(len(msg.out_kv_page_ids))
            msg.out_kv_offsets.append(i["out_offset"])
            msg.out_embed_ids += i["out_embeds"]
            msg.out_token_indices += i["out_indices"]
            msg.out_embed_indptr.append(len(msg.out_embed_ids))
            msg.attention_masks.append(i["mask"])
        return msg
    if kind == P.Kind.SAMPLE:
        msg = P.Sample(*([i[f] for i in items] for f in ("embed", "temperature", "top_k", "top_p", "seed")))
        if any(i.get("allowed") is not None for i in items):
            msg.allowed = [i.get("allowed") for i in items]
        return msg
    if kind == P.Kind.NEXT_DIST:
        return P.NextDist([i["embed"] for i in items], [i["k"] for i in items])
    if kind == P.Kind.COPY_KVPAGE:
        return P.CopyKvPage(*([i[f] for i in items] for f in ("src", "dst", "src_offset", "dst_offset", "length")))
    if kind == P.Kind.MASK_KVPAGE:
        return P.MaskKvPage([i["page"] for i in items], [i["mask"] for i in items])
    if kind == P.Kind.SWAP_KVPAGE:  # a command moves several pages: items are pages here
        return P.SwapKvPage(*(sum((i[f] for i in items), []) for f in ("device", "host", "to_host")))
    raise ValueError(f"not a batchable kind: {kind}")


def resolve_batch(batch: list[Command], reply: P.Message) -> None:
    """Map the reply's per-item results and errors back to each command's future."""
    errors: dict[int, str] = getattr(reply, "errors", {})
    spans = {P.Kind.EMBED_TEXT: "token_ids", P.Kind.SWAP_KVPAGE: "device"}
    if isinstance(reply, P.BatchReply) and batch and batch[0].kind in spans:
        start = 0  # items are tokens (embed_text) or pages (swap); a call owns a range of them
        for command in batch:
            n = len(command.item[spans[batch[0].kind]])
            bad = [errors[i] for i in range(start, start + n) if i in errors]
            start += n
            settle_command(command, bad[0] if bad else None, None)
        return
    for index, command in enumerate(batch):
        value = None
        if isinstance(reply, P.SampleReply):
            value = reply.token_ids[index]
        elif isinstance(reply, P.NextDistReply):
            value = (reply.token_ids[index], reply.probs[index])
        settle_command(command, errors.get(index), value)


def complete(markers: list[tuple[Command, HostError | None]]) -> None:
    for marker, error in markers:
        if marker.on_head:
            marker.on_head()
        if error is not None:
            marker.future.set_error(error)
        else:
            marker.future.set_result(None)


def abandon(command: Command, error: HostError) -> None:
    """A command that will never run: it fails, but a deferred release still releases."""
    if command.kind == P.Kind.PASS:
        fail([command], error)  # type: ignore[list-item]
        return
    if command.on_head:
        command.on_head()
    if command.on_done:
        command.on_done(error.message)
    command.future.set_error(error)


def settle_command(command: Command, error: str | None, value: Any) -> None:
    if command.on_done:
        command.on_done(error)
    if error is None:
        command.future.set_result(value)
        return
    failure = HostError(ErrorKind.INFERENCE_FAILED, f"{command.kind}: {error}")
    command.future.set_error(failure)
    if command.silent and command.queue.error is None:
        command.queue.error = failure
