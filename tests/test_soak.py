"""A short load/soak run in CI (benchmarks/soak.py has the long one): concurrent inferlets
with mixed workloads; no errors, no lost messages, every answer consistent, pools full, and
no thread or file descriptor leaked in the server."""

from __future__ import annotations

import asyncio

from benchmarks.soak import WORKLOADS, soak
from pie_server import TOKEN


def test_short_soak_loses_and_leaks_nothing(pie_server):
    report = asyncio.run(soak(pie_server.ws, TOKEN, instances=24, seconds=20, seed=7,
                              pid=pie_server.process.pid))
    assert report["errors"] == {}, report["error_examples"]
    assert report["lost_messages"] == 0 and report["wrong_answers"] == 0
    assert set(report["completed"]) == set(WORKLOADS)
    assert report["pools_reclaimed"], report
    assert not report["leak_check"]["leaked"], report["leak_check"]
