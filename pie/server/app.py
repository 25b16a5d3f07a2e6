"""The ASGI app: `GET /health` and the WebSocket RPC endpoint `/ws` (protocol: `rpc.py`).

The app is served before the backend is up, so `/health` can tell load balancers and
`pie run` when it is: `state.runtime` stays None until the backend handshake is done and
the runtime is built.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import FastAPI, Header, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse

from pie.config import ServerConfig
from pie.server import rpc
from pie.server.attachments import Attachments
from pie.server.openai import add_openai_routes
from pie.server.session import Session, authenticate

if TYPE_CHECKING:
    from pie.runtime.runtime import Runtime


@dataclass
class ServerState:
    config: ServerConfig
    runtime: Runtime | None = None  # set once the backend handshake is done
    model: str | None = None
    failure: str | None = None  # set if the backend dies: /health reports it
    draining: bool = False  # shutting down: running instances finish, no new launches


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="Pie", docs_url=None, redoc_url=None, openapi_url=None)
    attachments = Attachments(state.config.max_pending_messages)
    add_openai_routes(app, state)

    @app.get("/health")
    def health() -> JSONResponse:
        if state.failure is not None:
            return JSONResponse({"status": "failed", "reason": state.failure}, status_code=503)
        if state.runtime is None:
            return JSONResponse({"status": "starting"}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok", "model": state.model})

    @app.get("/stats")
    def stats(authorization: str | None = Header(default=None)) -> JSONResponse:
        """Scheduler statistics (batch sizes, waits), pool occupancy, host calls per program."""
        if authenticate(state.config.auth_tokens, (authorization or "").removeprefix("Bearer ")) is None:
            return JSONResponse({"error": "unauthenticated"}, status_code=401)
        if state.runtime is None:
            return JSONResponse({"status": "starting"}, status_code=503)
        return JSONResponse(state.runtime.stats())

    @app.websocket("/ws")
    async def rpc_endpoint(websocket: WebSocket) -> None:
        await websocket.accept()
        if state.runtime is None:
            await websocket.close(rpc.CLOSE_NOT_READY, "the backend is still starting; poll GET /health")
            return
        session = Session(state.config, state.runtime, attachments)
        writer = asyncio.create_task(_drain(session.outbox, websocket))
        try:
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    break
                if message.get("bytes") is not None:
                    await session.handle(message["bytes"])
                else:
                    session.reject_frame("frames must be binary (msgpack), not text")
        finally:
            writer.cancel()
            await session.close()

    return app


def ws_max_size(config: ServerConfig) -> int:
    """The largest frame the server reads: a full message or upload chunk plus its envelope.
    Larger frames close the connection (code 1009) instead of getting an error reply."""
    return max(config.max_message_bytes, rpc.CHUNK_BYTES) + 64 * 1024


async def _drain(outbox: asyncio.Queue[bytes], websocket: WebSocket) -> None:
    """Write replies and events in the order the session queued them."""
    try:
        while True:
            await websocket.send_bytes(await outbox.get())
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass  # the connection is gone; the receive loop sees the disconnect and cleans up
