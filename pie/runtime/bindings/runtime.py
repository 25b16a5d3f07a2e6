"""`runtime`: arguments, identity, logging, clock, randomness, models and queues."""

from __future__ import annotations

import logging
from typing import Any

from pie.runtime.bindings.common import PACKAGE, Bindings, Kind
from pie.runtime.host import HostState

log = logging.getLogger("pie.inferlet")
LEVELS = {"debug": 10, "info": 20, "warn": 30, "error": 40}


def _log(st: HostState, store: Any, level: str, message: str, max_bytes: int) -> None:
    """A line for the server log and, if the client asked (`logs` at launch), the client; a
    line over server.max_message_bytes is cut there (a log line never ends the instance)."""
    if len(message) > max_bytes // 4 and len(message.encode()) > max_bytes:
        message = message.encode()[:max_bytes - 64].decode(errors="ignore") + " [... cut at server.max_message_bytes]"
    log.log(LEVELS.get(level, 20), "[%s] %s", st.session.instance_id[:8], message)
    if level == "error" and message.startswith(("panicked at ", "out of memory: ")) and st.panic is None:
        # the SDK's panic hook or allocator (sdk/rust/inferlet/src/oom.rs): the end reason if it traps
        st.panic = message.splitlines()[0][:1000]
    if st.forward_log is not None:
        st.pace("messages_per_s")
        room = st.forward_log(level, message)
        if room is not None:  # the client is not reading: wait, as for a message
            st.wait_for(room)


def register(root: Any, b: Bindings) -> None:
    with root.add_instance(PACKAGE.format("runtime")) as runtime:
        b.counted(runtime)
        runtime.add_func("get-arguments", b.call(lambda st, store: list(st.session.arguments), False))
        runtime.add_func("instance-id", b.call(lambda st, store: st.session.instance_id, False))
        runtime.add_func("version", b.call(lambda st, store: st.session.version(), False))
        max_bytes = b.controller.config.server.max_message_bytes
        runtime.add_func("log", b.call(lambda st, store, level, message: _log(st, store, level, message, max_bytes),
                                       False))
        runtime.add_func("now", b.call(lambda st, store: st.session.now_ns(), False))
        runtime.add_func("random-bytes", b.call(lambda st, store, n: list(st.session.random_bytes(n))))
        runtime.add_func("available-models", b.call(lambda st, store: st.session.available_models(), False))
        runtime.add_func("available-traits", b.call(lambda st, store, m: st.session.available_traits(m)))
        runtime.add_func("create-queue",
                         b.call(lambda st, store, m: st.own(Kind.QUEUE, st.session.create_queue(m))))
        runtime.add_func("synchronize", b.call(lambda st, store, q: st.own(
            Kind.FUTURE_UNIT, st.session.synchronize(b.queue(st, store, q))), False))
        runtime.add_func("set-queue-priority", b.call(
            lambda st, store, q, p: st.session.set_queue_priority(b.queue(st, store, q), p), False))
