"""HTTP for inferlets: allowlisted hosts only, run on a small thread pool so a slow server
never blocks the calling inferlet's other work (it gets a future)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx

from pie.config import ControlConfig
from pie.control.errors import ErrorKind, HostError
from pie.control.future import HostFuture


class HttpClient:
    def __init__(self, config: ControlConfig):
        self.allowlist = set(config.http_allowlist)
        self.client = httpx.Client(timeout=config.http_timeout_s, follow_redirects=False)
        self.pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="pie-http")

    def request(self, method: str, url: str, headers: list[tuple[str, str]],
                body: str | None = None) -> HostFuture:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise HostError(ErrorKind.INVALID_ARGUMENT, f"not an http(s) URL: {url!r}")
        if parts.hostname not in self.allowlist:
            raise HostError(ErrorKind.PERMISSION_DENIED,
                            f"host {parts.hostname!r} is not in control.http_allowlist")
        future = HostFuture()

        def run() -> None:
            try:
                response = self.client.request(method, url, headers=headers, content=body)
                future.set_result((response.status_code, response.text))
            except httpx.HTTPError as e:
                future.set_error(HostError(ErrorKind.IO, f"{method} {url}: {e}"))

        self.pool.submit(run)
        return future

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
