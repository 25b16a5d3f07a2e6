"""The ASGI app: `GET /health` and the WebSocket RPC endpoint `/ws` (protocol: `rpc.py`).

The app is served before the backend is up, so `/health` can tell load balancers and
`pie run` when it is: `state.runtime` stays None until the backend handshake is done and
the runtime is built.

Each connection has a reader (requests, one at a time) and a writer (its session's outbox).
When the outbox is over server.max_outbox_bytes the reader waits and the connection's
instances wait in `send`; if the client then takes nothing for server.slow_client_timeout_s
its instances are ended, saying why, and the connection is closed (code 1008, the same
reason) once the client has read what was queued — or dropped if it takes nothing for
slow_client_timeout_s more.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import FastAPI, Header, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse, Response

from pie.config import ServerConfig
from pie.server import rpc
from pie.server.attachments import Attachments, Close, Outbox
from pie.server.metrics import CONTENT_TYPE, render
from pie.server.openai import add_openai_routes
from pie.server.openai_responses import add_responses_routes
from pie.server.response_store import ResponseStore
from pie.server.session import Session, UploadBudget, authenticate, is_admin

if TYPE_CHECKING:
    from pie.runtime.runtime import Runtime


@dataclass
class ServerState:
    config: ServerConfig
    runtime: Runtime | None = None  # set once the backend handshake is done
    model: str | None = None
    draining: bool = False  # shutting down: running instances finish, no new launches
    responses: ResponseStore = field(init=False)  # /v1/responses kept for previous_response_id

    def __post_init__(self) -> None:
        self.responses = ResponseStore(self.config.max_stored_responses)

    def replicas(self) -> list[dict]:
        """Each backend replica's state for /health: ok, or failed with why (it is being
        restarted, or its restarts failed)."""
        return [] if self.runtime is None else self.runtime.replica_health()

    @property
    def failure(self) -> str | None:
        """Why nothing can be served: every backend replica is down."""
        replicas = self.replicas()
        if replicas and all(r["status"] == "failed" for r in replicas):
            return "; ".join(r["reason"] for r in replicas)
        return None


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="Pie", docs_url=None, redoc_url=None, openapi_url=None)
    attachments = Attachments(state.config.max_pending_messages, state.config.max_pending_bytes)
    budget = UploadBudget(state.config)  # uploads in progress, over every connection
    add_openai_routes(app, state)
    add_responses_routes(app, state)

    @app.get("/health")
    def health() -> JSONResponse:
        """200 while at least one backend replica serves ("ok", or "degraded" when others are
        down); 503 while starting, draining, or when no replica serves ("failed")."""
        if state.failure is not None:
            return JSONResponse({"status": "failed", "reason": state.failure}, status_code=503)
        if state.runtime is None:
            return JSONResponse({"status": "starting"}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        replicas = state.replicas()
        # Some replicas down: still serving (launches go to the others), "degraded".
        status = "ok" if all(r["status"] == "ok" for r in replicas) else "degraded"
        return JSONResponse({"status": status, "model": state.model, "replicas": replicas})

    @app.get("/stats")
    def stats(authorization: str | None = Header(default=None)) -> JSONResponse:
        """Scheduler statistics (batch sizes, waits), pool occupancy, host calls per program;
        the usage of the caller's user only, unless it is an admin (server.admin_tokens) or
        the server has no tokens (then there is one user)."""
        given = (authorization or "").removeprefix("Bearer ")
        user = authenticate(state.config.tokens, given)
        if user is None:
            return JSONResponse({"error": "unauthenticated"}, status_code=401)
        if state.runtime is None:
            return JSONResponse({"status": "starting"}, status_code=503)
        everyone = not state.config.tokens or is_admin(state.config, given)
        return JSONResponse(state.runtime.stats(None if everyone else user))

    @app.get("/metrics")
    def metrics(authorization: str | None = Header(default=None)) -> Response:
        """`/stats` in Prometheus' text format (pie/server/metrics.py); every user's, so only
        for an admin token when the server has tokens."""
        given = (authorization or "").removeprefix("Bearer ")
        if state.config.tokens and not is_admin(state.config, given):
            return JSONResponse({"error": "GET /metrics needs a token of server.admin_tokens"}, status_code=401)
        runtime = state.runtime
        return Response(render(lambda: None if runtime is None else runtime.stats(None)), media_type=CONTENT_TYPE)

    @app.websocket("/ws")
    async def rpc_endpoint(websocket: WebSocket) -> None:
        await websocket.accept()
        if state.runtime is None:
            await websocket.close(rpc.CLOSE_NOT_READY, "the backend is still starting; poll GET /health")
            return
        session = Session(state.config, state.runtime, attachments, budget)
        slow = asyncio.Event()
        writer = asyncio.create_task(_write(session.outbox, websocket))
        watchdog = asyncio.create_task(_watch(session, slow))
        try:
            await _read(session, websocket, slow)
            if session.slow_reason is not None:
                # End its instances (their ends queued behind what it has not read) and
                # write all that and the close frame for as long as the client takes some
                # of it at least every slow_client_timeout_s; then give up on it.
                await session.end_for_slow_client(session.slow_reason)
                session.outbox.put(Close(rpc.CLOSE_SLOW_CLIENT, session.slow_reason))
                await _finish_writing(writer, session.outbox, state.config.slow_client_timeout_s)
        finally:
            watchdog.cancel()
            writer.cancel()
            await session.close()

    return app


def ws_max_size(config: ServerConfig) -> int:
    """The largest frame the server reads: a full message or upload chunk plus its envelope.
    Larger frames close the connection (code 1009) instead of getting an error reply."""
    return max(config.max_message_bytes, rpc.CHUNK_BYTES) + 64 * 1024


async def _read(session: Session, websocket: WebSocket, slow: asyncio.Event) -> None:
    """Handle the client's frames one at a time until it disconnects, or until the writer
    finds that it stopped reading (`slow`; a request in progress is finished first). No
    frame is read while the outbox is over its bound."""
    stop = asyncio.ensure_future(slow.wait())
    try:
        while True:
            step = asyncio.ensure_future(_next_frame(session, websocket))
            await asyncio.wait({step, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                return
            message = step.result()
            if message["type"] == "websocket.disconnect":
                return
            if message.get("bytes") is not None:
                await session.handle(message["bytes"])
            else:
                session.reject_frame("frames must be binary (msgpack), not text")
    finally:
        stop.cancel()


async def _next_frame(session: Session, websocket: WebSocket) -> dict:
    await session.outbox.wait_room()
    return await websocket.receive()


async def _write(outbox: Outbox, websocket: WebSocket) -> None:
    """Write replies and events in the order the session queued them; after a `Close`,
    close the connection."""
    try:
        while True:
            frame = await outbox.get()
            if isinstance(frame, Close):
                await websocket.close(frame.code, _truncate(frame.reason, 123))
                return
            await websocket.send_bytes(frame)
            outbox.sent(frame)
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass  # the connection is gone; the reader sees the disconnect and cleans up


async def _watch(session: Session, slow: asyncio.Event) -> None:
    """Set the session's `slow_reason` and `slow` once its outbox has been over its bound
    for server.slow_client_timeout_s without the client taking a frame."""
    outbox, timeout = session.outbox, session.config.slow_client_timeout_s
    while outbox.stalled_s() < timeout:
        await asyncio.sleep(min(1.0, timeout / 4, max(0.01, timeout - outbox.stalled_s())))
    session.slow_reason = (f"the client stopped reading: {outbox.bytes} bytes unread for {timeout:g} s "
                           f"(server.max_outbox_bytes, server.slow_client_timeout_s)")
    slow.set()


async def _finish_writing(writer: asyncio.Task, outbox: Outbox, timeout_s: float) -> None:
    """Until the writer is done, or the client has taken nothing for `timeout_s`."""
    since = time.monotonic()
    while not writer.done():
        await asyncio.wait({writer}, timeout=min(1.0, timeout_s / 4))
        if time.monotonic() - max(since, outbox.written_at) >= timeout_s:
            return


def _truncate(text: str, max_bytes: int) -> str:
    """`text` cut to at most `max_bytes` of UTF-8 (a close frame's reason holds 123)."""
    return text.encode()[:max_bytes].decode(errors="ignore")
