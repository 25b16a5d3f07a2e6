"""The scheduler's thread and its socket to one backend (`SchedulerChannel`): the only I/O of
the batching path. The scheduler (pie/control/scheduler.py) decides what to send and what a
reply settles; this thread waits on the socket, the wake pipe the instance threads write to,
and a monitor of the link, and calls the scheduler back:

* `dispatch(send)` whenever anything may have changed (a call submitted, a reply, a timeout
  the policy asked for), which returns how long the thread may then sleep;
* `on_reply(frame)` for each reply, which returns the instances' events to set — after the
  next batch has left, so it is not queued behind ~130 threads waking for the GIL;
* `on_malformed(reason)` for a reply that does not decode, `fail_all(reason)` if the loop
  itself fails (a scheduler bug fails every waiting call instead of hanging it).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Protocol

import zmq
from zmq.utils.monitor import recv_monitor_message

from pie import protocol as P
from pie.transport import for_endpoint, secure_client

log = logging.getLogger("pie.control")


class Dispatcher(Protocol):
    def dispatch(self, send: Callable[[bytes], None]) -> int | None: ...
    def on_reply(self, frame: bytes) -> list[threading.Event]: ...
    def on_malformed(self, reason: str) -> None: ...
    def fail_all(self, reason: str) -> None: ...


class SchedulerChannel:
    """`secret`: the link's CURVE secret (pie/transport.py), for a remote backend."""

    def __init__(self, dispatcher: Dispatcher, endpoint: str, secret: bytes | None = None):
        self.dispatcher = dispatcher
        self.endpoint = endpoint
        self.secret = secret
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_read, False)
        self.running = True
        self.reconnect = False  # set by `renew`: the loop replaces its socket
        # Why the link dropped (`_connect`'s monitor saw it), until `renew`.
        self.disconnected: str | None = None
        self.thread = threading.Thread(target=self._loop, name="pie-scheduler", daemon=True)
        self.thread.start()

    def wake(self) -> None:
        """Have the thread call `dispatch` again (from any thread)."""
        os.write(self.wake_write, b"x")

    def renew(self) -> None:
        """A new backend serves the endpoint: use a fresh socket (nothing queued for the dead
        backend reaches the new one)."""
        self.disconnected = None
        self.reconnect = True
        self.wake()

    def stop(self) -> None:
        self.running = False
        self.wake()
        self.thread.join(5)

    def _connect(self, context: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
        """The link and a monitor of its disconnections: a backend that ended (or was
        replaced at the same address: a remote one restarted between two of the watchdog's
        pings) took the batch in flight and its KV cache with it (`disconnected`)."""
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        secure_client(socket, for_endpoint(self.endpoint, self.secret))
        monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        socket.connect(self.endpoint)
        return socket, monitor

    def _loop(self) -> None:
        context = zmq.Context()
        socket, monitor = self._connect(context)
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        poller.register(self.wake_read, zmq.POLLIN)
        try:
            while self.running:
                if self.reconnect:
                    self.reconnect = False
                    for old in (socket, monitor):
                        poller.unregister(old)
                    socket.disable_monitor()
                    monitor.close()
                    socket.close()
                    socket, monitor = self._connect(context)
                    poller.register(socket, zmq.POLLIN)
                    poller.register(monitor, zmq.POLLIN)
                timeout_ms = self.dispatcher.dispatch(socket.send)
                for source, _ in poller.poll(timeout_ms):
                    if source is monitor:
                        recv_monitor_message(monitor)
                        self.disconnected = (f"the connection to the backend at {self.endpoint} was lost "
                                             f"(its process ended or was replaced)")
                    elif source is socket:
                        self._receive(socket)
                    else:
                        try:
                            os.read(self.wake_read, 4096)
                        except BlockingIOError:
                            pass
        except Exception as e:
            log.exception("scheduler stopped")
            self.dispatcher.fail_all(f"scheduler failed: {e}")
        finally:
            socket.disable_monitor()
            monitor.close()
            socket.close()
            context.term()

    def _receive(self, socket: zmq.Socket) -> None:
        """Every reply waiting on the socket; then the next batch leaves before any instance's
        thread wakes to compete for the GIL (`settle` in pie/control/passes.py)."""
        wakes: list[threading.Event] = []
        try:
            while socket.poll(0):
                frame = socket.recv()
                try:
                    wakes += self.dispatcher.on_reply(frame)
                except P.ProtocolError as e:
                    self.dispatcher.on_malformed(f"the backend at {self.endpoint} sent a malformed reply: {e}")
            if wakes:
                self.dispatcher.dispatch(socket.send)
        finally:
            for event in wakes:
                event.set()
