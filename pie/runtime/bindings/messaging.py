"""`messaging`: messages to and from the client, broadcast topics and subscriptions."""

from __future__ import annotations

from typing import Any

from wasmtime.component import ResourceType

from pie.control.errors import HostError
from pie.runtime.bindings.common import PACKAGE, Bindings, Kind
from pie.runtime.host import HostState, LimitExceeded


def register(root: Any, b: Bindings) -> None:
    max_bytes = b.controller.config.server.max_message_bytes

    def check_size(message: str) -> None:
        if (size := len(message.encode())) > max_bytes:
            raise LimitExceeded(f"a message of {size} bytes exceeds server.max_message_bytes = {max_bytes}")

    def send(st: HostState, store: Any, message: str) -> None:
        check_size(message)
        st.pace("messages_per_s")
        room = st.send_message(message)
        if room is not None:  # nobody is attached and too many messages are held
            st.wait_for(room)

    def broadcast(st: HostState, store: Any, topic: str, message: str) -> None:
        check_size(message)
        st.pace("messages_per_s")
        try:
            st.session.broadcast(topic, message)
        except HostError as e:  # broadcast has no error result: the refusal ends the instance
            raise LimitExceeded(f"broadcast refused: {e.kind}: {e.message}") from None

    with root.add_instance(PACKAGE.format("messaging")) as messaging:
        b.counted(messaging)
        messaging.add_resource("subscription", ResourceType.host(Kind.SUBSCRIPTION), b.drop)
        messaging.add_func("send", b.call(send, False))
        messaging.add_func("receive",
                           b.call(lambda st, store: st.own(Kind.FUTURE_STRING, st.session.receive()), False))
        messaging.add_func("broadcast", b.call(broadcast, False))
        messaging.add_func("subscribe",
                           b.call(lambda st, store, t: st.own(Kind.SUBSCRIPTION, st.session.subscribe(t))))
        messaging.add_func("[method]subscription.next", b.call(
            lambda st, store, sub: st.own(Kind.FUTURE_STRING,
                                         st.get(store, sub, Kind.SUBSCRIPTION).next()), False))
