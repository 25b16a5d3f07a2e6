"""HTTP for inferlets: allowlisted hosts only, run on a small thread pool so a slow server
never blocks the calling inferlet's other work (it gets a future).

A response body is read in pieces and given up at control.http_max_response_bytes (an
`io` error naming the key), never read whole first; the whole exchange is bounded by
control.http_timeout_s. Requests to the Pie server's own port on this machine are refused
(`protect`): loopback is on the default allowlist for the local tool server, and an
inferlet must not reach its own server's /stats, /ws or /v1 through it.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx

from pie.config import ControlConfig, is_loopback
from pie.control.errors import ErrorKind, HostError
from pie.control.future import HostFuture


class HttpClient:
    def __init__(self, config: ControlConfig):
        self.allowlist = set(config.http_allowlist)
        self.max_bytes = config.http_max_response_bytes
        self.timeout_s = config.http_timeout_s
        self.client = httpx.Client(timeout=config.http_timeout_s, follow_redirects=False)
        self.pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="pie-http")
        self.server_ports: set[int] = set()  # where the Pie server listens (see `protect`)
        self.server_hosts: set[str] = set()

    def protect(self, host: str, port: int) -> None:
        """The Pie server listens on `host`:`port`: refuse requests to that port on any
        address of this machine (loopback, the bind address, the machine's own addresses)."""
        self.server_hosts.add(host)
        self.server_ports.add(port)

    def request(self, method: str, url: str, headers: list[tuple[str, str]],
                body: str | None = None) -> HostFuture:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise HostError(ErrorKind.INVALID_ARGUMENT, f"not an http(s) URL: {url!r}")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise HostError(ErrorKind.INVALID_ARGUMENT, f"invalid port in {url!r}") from None
        host = parts.hostname
        if host not in self.allowlist:
            raise HostError(ErrorKind.PERMISSION_DENIED,
                            f"host {host!r} is not in control.http_allowlist")
        if port in self.server_ports and self._names_this_machine(host):
            raise self._own_server(host, port)
        future = HostFuture()

        def run() -> None:
            try:
                # A name may resolve to this machine: check what it resolves to now.
                if port in self.server_ports and self._resolves_here(host, port):
                    raise self._own_server(host, port)
                future.set_result(self._fetch(method, url, headers, body))
            except HostError as e:
                future.set_error(e)
            except httpx.HTTPError as e:
                future.set_error(HostError(ErrorKind.IO, f"{method} {url}: {e}"))
            except Exception as e:  # e.g. a header httpx cannot encode: the caller's error
                future.set_error(HostError(ErrorKind.IO, f"{method} {url}: {type(e).__name__}: {e}"))

        self.pool.submit(run)
        return future

    def _fetch(self, method: str, url: str, headers: list[tuple[str, str]],
               body: str | None) -> tuple[int, str]:
        """(status, body text), reading the body in pieces up to the cap."""
        start = time.monotonic()
        with self.client.stream(method, url, headers=headers, content=body) as response:
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > self.max_bytes:
                raise self._too_large(method, url, f"it declares {declared} bytes")
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > self.max_bytes:
                    raise self._too_large(method, url, f"stopped reading after {size} bytes")
                if time.monotonic() - start > self.timeout_s:
                    raise HostError(ErrorKind.IO, f"{method} {url}: the response took longer than "
                                                  f"control.http_timeout_s = {self.timeout_s:g} s")
                chunks.append(chunk)
            data = b"".join(chunks)
            del chunks
            try:
                text = data.decode(response.encoding or "utf-8", errors="replace")
            except LookupError:  # a charset Python does not know
                text = data.decode("utf-8", errors="replace")
            return response.status_code, text

    def _too_large(self, method: str, url: str, detail: str) -> HostError:
        return HostError(ErrorKind.IO, f"{method} {url}: the response body exceeds "
                                       f"control.http_max_response_bytes = {self.max_bytes} ({detail})")

    def _own_server(self, host: str, port: int) -> HostError:
        return HostError(ErrorKind.PERMISSION_DENIED,
                         f"{host}:{port} is this Pie server's own address: inferlets may not send "
                         f"requests to the server they run on (control.http_allowlist allows "
                         f"{host!r} for other ports only)")

    def _names_this_machine(self, host: str) -> bool:
        """Whether the literal `host` is this machine (no name resolution)."""
        if is_loopback(host) or host in self.server_hosts:
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        mapped = getattr(address, "ipv4_mapped", None)
        return address.is_unspecified or (mapped is not None and (mapped.is_loopback or mapped.is_unspecified))

    def _resolves_here(self, host: str, port: int) -> bool:
        """Whether `host` resolves to an address of this machine (one a socket can bind)."""
        if self._names_this_machine(host):
            return True
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            return False  # the request itself will fail and say why
        for family, _, _, _, address in infos:
            ip = ipaddress.ip_address(address[0].split("%")[0])
            if ip.is_loopback or ip.is_unspecified or _is_local_address(family, address):
                return True
        return False

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()


def _is_local_address(family: int, address: tuple) -> bool:
    """Whether `address` belongs to one of this machine's interfaces: only then can a
    socket bind it."""
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((address[0], 0, *address[2:]))
        return True
    except OSError:
        return False
