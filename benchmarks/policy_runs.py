"""What the policy benchmarks (`api_serve.py`, `prefill_only.py`) share: one `pie serve`
per policy with its own config, driven by seeded Poisson arrivals, and the sustained rate
of each policy at a latency SLO."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx

from pie.client import PieClient, http_url
from pie.server.local import LocalServer


@asynccontextmanager
async def serving(tmp: Path, name: str, toml: str, dtype: str, program: Path
                  ) -> AsyncIterator[tuple[PieClient, str, Callable[[], Awaitable[dict]]]]:
    """A `pie serve` configured by `toml` (config and log in `tmp` as `name`.toml/.log), a
    client that uploaded `program`: (client, the program's digest, its `/stats` resources)."""
    config = tmp / f"{name}.toml"
    config.write_text(toml)
    with (tmp / f"{name}.log").open("ab") as log:
        async with LocalServer(["--dtype", dtype, "--config", str(config)], stderr=log) as url, \
                PieClient(url) as client, httpx.AsyncClient() as http:
            async def resources() -> dict:
                return (await http.get(f"{http_url(url)}/stats")).json()["resources"]

            yield client, await client.upload(program.read_bytes()), resources


def sustained(points: list[tuple[float, float]], slo: float) -> float:
    """The highest rate of (rate, latency) `points` whose latency is at most `slo`,
    interpolated between measured rates."""
    points = sorted(points)
    best = 0.0
    for low, high in zip([None] + points, points):
        if high[1] <= slo:
            best = high[0]
            continue
        if low is not None and low[1] <= slo:
            best = low[0] + (slo - low[1]) / (high[1] - low[1]) * (high[0] - low[0])
        break
    return best
