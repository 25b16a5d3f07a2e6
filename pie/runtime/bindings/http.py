"""`http`: outbound HTTP requests (allowlisted, rate-limited) and their futures."""

from __future__ import annotations

from typing import Any

from wasmtime.component import ResourceType

from pie.runtime.bindings.common import PACKAGE, Bindings, Kind, record
from pie.runtime.host import HostState


def _request(st: HostState, method: str, url: str, headers: Any, body: str | None = None) -> Any:
    st.pace("http_requests_per_s")
    return st.own(Kind.FUTURE_RESPONSE, st.session.http(method, url, list(headers), body))


def register(root: Any, b: Bindings) -> None:
    with root.add_instance(PACKAGE.format("http")) as http:
        b.counted(http)
        http.add_resource("future-response", ResourceType.host(Kind.FUTURE_RESPONSE), b.drop)
        http.add_func("http-get", b.call(lambda st, store, url, headers: _request(st, "GET", url, headers)))
        http.add_func("http-post", b.call(
            lambda st, store, url, headers, body: _request(st, "POST", url, headers, body)))
        http.add_func("[method]future-response.subscribe", b.call(b.subscribe_to(Kind.FUTURE_RESPONSE), False))
        http.add_func("[method]future-response.get", b.call(b.future_getter(
            Kind.FUTURE_RESPONSE,
            lambda f: b.tagged(f, lambda r: record(status=r[0], body=r[1]))), False))
