"""A short load/soak run in CI (benchmarks/soak.py has the long one): concurrent inferlets
with mixed workloads; no errors, no lost messages, every answer consistent, pools full."""

from __future__ import annotations

import asyncio
import sys

from pie_server import ROOT, TOKEN

sys.path.insert(0, str(ROOT / "benchmarks"))
from soak import WORKLOADS, soak  # noqa: E402


def test_short_soak_loses_nothing(pie_server):
    report = asyncio.run(soak(pie_server.ws, TOKEN, instances=24, seconds=20, seed=7))
    assert report["errors"] == {}, report["error_examples"]
    assert report["lost_messages"] == 0 and report["wrong_answers"] == 0
    assert set(report["completed"]) == set(WORKLOADS)
    assert report["pools_reclaimed"], report
