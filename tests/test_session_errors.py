"""The RPC session answers each runtime refusal with its own error code, by the refusal's
type: an exception that merely shares a base class (a KeyError is a LookupError, a torch
error a RuntimeError, any ValueError...) is a server fault, answered `internal`, never
taken for "unknown program" or "launch refused". A stand-in runtime, inside the server
layer's unit test (the real runtime's refusals: tests/test_server.py, tests/test_quotas.py)."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from pie.config import ServerConfig
from pie.runtime.runtime import InboxFull, LaunchRefused, UnknownInstance, UnknownProgram
from pie.server import rpc
from pie.server.attachments import Attachments
from pie.server.rpc import ErrorCode
from pie.server.session import Session


class Refusing:
    """Every call raises `error`."""

    def __init__(self, error: Exception):
        self.error = error

    def launch(self, *args, **kwargs):
        raise self.error

    def send(self, *args, **kwargs):
        raise self.error

    def terminate(self, *args, **kwargs):
        raise self.error


def answer(error: Exception, request: dict, instance: str | None = None) -> tuple[str, str]:
    """The (code, message) a session over a runtime raising `error` sends for `request`."""
    session = Session(ServerConfig(), Refusing(error), Attachments(16))  # type: ignore[arg-type]
    if instance is not None:  # an attached instance the request may name
        session.instances[instance] = None  # type: ignore[assignment]

    async def run() -> bytes:
        await session.handle(msgpack.packb({"corr_id": 7, **request}))
        return await session.outbox.get()  # type: ignore[return-value]

    reply = rpc.decode_server_message(asyncio.run(run()))
    assert isinstance(reply, rpc.Error) and reply.corr_id == 7
    return reply.code, reply.message


LAUNCH = {"type": "launch", "program": "hello"}
SEND = {"type": "send", "instance_id": "i", "message": "hi"}
TERMINATE = {"type": "terminate", "instance_id": "i"}


@pytest.mark.parametrize("error,request_,code", [
    (UnknownProgram("no program 'hello'"), LAUNCH, ErrorCode.UNKNOWN_PROGRAM),
    (LaunchRefused("the server is shutting down"), LAUNCH, ErrorCode.LAUNCH_REFUSED),
    (KeyError("a bug"), LAUNCH, ErrorCode.INTERNAL),
    (RuntimeError("a bug"), LAUNCH, ErrorCode.INTERNAL),
    (UnknownInstance("no live instance 'i'"), SEND, ErrorCode.UNKNOWN_INSTANCE),
    (InboxFull("the instance has 64 unread messages"), SEND, ErrorCode.INBOX_FULL),
    (OverflowError("a bug"), SEND, ErrorCode.INTERNAL),
    (IndexError("a bug"), SEND, ErrorCode.INTERNAL),
    (UnknownInstance("no live instance 'i'"), TERMINATE, ErrorCode.UNKNOWN_INSTANCE),
    (LookupError("a bug"), TERMINATE, ErrorCode.INTERNAL),
])
def test_each_refusal_has_its_code_and_nothing_else_borrows_it(error, request_, code):
    got, message = answer(error, request_, instance="i")
    assert got == code
    assert str(error.args[0]) in message

