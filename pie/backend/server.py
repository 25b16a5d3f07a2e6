"""The inference process: one ZeroMQ ROUTER socket, one loop, one batch at a time.

Receive a frame, run its handler, reply, take the steps the request's items go on with
(`Passes.ahead`, pie/backend/ahead.py) until they stop or another frame waits, then tell
that peer the backend is idle (the signal that drives the control layer's work-conserving
scheduler). A swap over an emulated
link (`backend.swap_gbps`) is answered once the link would have carried it; the loop goes
on meanwhile. Nothing a peer sends
can stop the loop: a bad frame or item gets an error reply, and so does a bug in a handler.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import signal
import time
import traceback
from pathlib import Path

import torch
import zmq

from pie import protocol as P
from pie.backend.engine import Engine
from pie.config import BackendConfig
from pie.transport import check_endpoint, for_endpoint, load_secret, secure_server

log = logging.getLogger("pie.backend")


class BackendServer:
    """`secret`: serve over CURVE, admitting only the control side's key (pie/transport.py);
    without one, a tcp endpoint off loopback is refused."""

    def __init__(self, engine: Engine, endpoint: str, secret: bytes | None = None,
                 parent: int | None = None):
        check_endpoint(endpoint, secret)
        secret = for_endpoint(endpoint, secret)
        self.engine = engine
        self.endpoint = endpoint
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.auth = secure_server(self.socket, self.context, secret) if secret is not None else None
        self.socket.bind(endpoint)
        self.running = True
        # `pie backend --exit-with PID`: the pid that started it. A backend whose control
        # process was killed outright (SIGKILL, the OOM killer) went on holding its ~2 GB and
        # its socket until someone found it; now it ends at its next idle poll (<= 200 ms).
        self.parent = parent

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        # Replies held until an emulated link would have carried a swap (backend.swap_gbps):
        # (when, order, frames), soonest first; the loop computes other batches meanwhile.
        held: list[tuple[float, int, list[bytes]]] = []
        order = itertools.count()
        while self.running:
            now = time.monotonic()
            while held and held[0][0] <= now:
                self.socket.send_multipart(heapq.heappop(held)[2])
            timeout = 200 if not held else max(1, int((held[0][0] - now) * 1e3) + 1)
            if not poller.poll(timeout=min(200, timeout)):
                if self.parent is not None and os.getppid() != self.parent:
                    log.warning("the process that started this backend (pid %d) has ended: exiting", self.parent)
                    break
                continue
            frames = self.socket.recv_multipart()
            # DEALER peers send [payload]; ROUTER prepends the peer identity. REQ peers add an
            # empty delimiter; everything before the payload is echoed back as the envelope.
            envelope, payload = frames[:-1], frames[-1]
            request_id, frame = self.handle_frame(payload)
            reply = [*envelope, frame]
            if (hold := self.engine.take_hold()) is not None:
                heapq.heappush(held, (hold, next(order), reply))
            else:
                self.socket.send_multipart(reply)
            if self.engine.ahead is not None:
                self.go_ahead(envelope, request_id)
            self.socket.send_multipart([*envelope, P.encode(P.IDLE_REQUEST_ID, P.Idle())])
        self.socket.close()
        if self.auth is not None:
            self.auth.stop()
        self.context.term()

    def handle_frame(self, payload: bytes) -> tuple[int, bytes]:
        """(The request's id, -1 where unreadable; the reply frame.)"""
        request_id = -1
        self.engine.ahead = None
        try:
            request_id, kind, body = P.decode_envelope(payload)
            if kind not in P.REQUESTS:
                raise P.ProtocolError(f"{kind} is not a request")
            message = P.parse_body(P.REQUESTS[kind], body)
            started = time.perf_counter()
            reply = self.engine.handle(message)
            log.debug("%s took %.2f ms", kind, (time.perf_counter() - started) * 1e3)
            return request_id, P.encode(request_id, reply, kind)
        except P.ProtocolError as e:
            self.engine.ahead = None
            return request_id, P.encode(request_id, P.ErrorReply(str(e)))
        except Exception as e:  # a handler bug must not take the backend down
            self.engine.ahead = None
            log.error("internal error handling request %s:\n%s", request_id, traceback.format_exc())
            return request_id, P.encode(request_id, P.ErrorReply(f"internal error: {type(e).__name__}: {e}"))

    def go_ahead(self, envelope: list[bytes], request_id: int) -> None:
        """Step the items of the request just answered that go on (`engine.ahead`), one
        `PassesStep` a step, the last `final`: when none has steps left or a frame waits on
        the socket (an `Interrupt`, or any request: it is served next). A failing step ends
        them all with its error on every item still going."""
        ahead = self.engine.ahead
        while ahead is not None:
            if self.socket.poll(0):
                tokens, errors, final = ahead.unstepped(), {}, True
            else:
                try:
                    tokens, errors = ahead.step()
                except Exception as e:  # a bug must not take the backend down
                    log.error("internal error stepping request %s ahead:\n%s", request_id, traceback.format_exc())
                    tokens, errors = ahead.unstepped(), ahead.abandon(f"internal error: {type(e).__name__}: {e}")
                final = ahead.done or bool(self.socket.poll(0))
            self.socket.send_multipart([*envelope, P.encode(request_id, P.PassesStep(
                tokens=tokens.tobytes(), final=final, errors=errors))])
            if final:
                ahead = self.engine.ahead = None

    def stop(self, *_: object) -> None:
        self.running = False


def run_backend(model_dir: Path, config: BackendConfig, endpoint: str, parent: int | None = None) -> None:
    """Entry point of `pie backend`: load the model, bind, serve until SIGINT/SIGTERM (or,
    with `parent`, until that process, its parent, has ended: `--exit-with`)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    secret = load_secret(config.secret_file)
    check_endpoint(endpoint, secret)  # before minutes of loading, not after
    started = time.monotonic()
    engine = Engine(model_dir, config)
    server = BackendServer(engine, endpoint, secret, parent)
    signal.signal(signal.SIGTERM, server.stop)
    signal.signal(signal.SIGINT, server.stop)
    log.info(
        "backend ready on %s%s (%s, %s%s, %s; loaded in %.1f s)",
        endpoint, " (CURVE, shared secret)" if for_endpoint(endpoint, secret) else "", model_dir.name, engine.config.dtype,
        " with int8 weights" if config.weight_dtype == "int8"
        else ", prefills in float32" if engine.config.prefill_dtype == "float32" else "", config.device,
        time.monotonic() - started,
    )
    server.serve_forever()
