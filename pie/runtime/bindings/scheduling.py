"""`scheduling`: a queue's objective, task group and job-size hint (the batch scheduler's
ordering, pie/control/policies.py)."""

from __future__ import annotations

from typing import Any

from pie.runtime.bindings.common import PACKAGE, Bindings


def register(root: Any, b: Bindings) -> None:
    with root.add_instance(PACKAGE.format("scheduling")) as scheduling:
        b.counted(scheduling)
        # wasmtime-py passes an enum as its case name ("latency", "throughput", "background").
        scheduling.add_func("set-queue-objective", b.call(
            lambda st, store, q, objective, group: st.session.set_queue_objective(
                b.queue(st, store, q), objective, group)))
        scheduling.add_func("set-job-size", b.call(
            lambda st, store, q, tokens: st.session.set_job_size(b.queue(st, store, q), tokens)))
