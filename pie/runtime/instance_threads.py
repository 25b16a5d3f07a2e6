"""Threads started ahead of the instances that will run on them (`InstanceThreads`).

Each instance runs on a thread of its own (pie/runtime/runtime.py). Starting that thread in
`launch` made the launcher wait in `Thread.start()` until the new thread had been scheduled
and had taken the GIL: with 128 instances launched at once over one RPC connection (Table
5's workload) and the first ones already decoding, that wait was 3.0 ms median, 5.8 ms p90,
per launch, 383 of the 439 ms the server spent on those 128 launch requests (Zen 4, 2
vCPUs, /tmp probe of 2026-12-08), so the last instance started ~0.6 s after the first.

Here `runtime.idle_threads` threads are started with the runtime and wait on a queue;
`run` hands one a job and returns at once. A thread whose instance ended goes back to
waiting while fewer than that many wait, else it ends. With none waiting, `run` starts a
thread as before (a burst beyond the pool pays the old cost, nothing worse). Idle threads
cost no CPU (blocked on the queue) and little memory (their stacks are reserved, not
touched).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("pie.runtime")

Job = Callable[[], None]


class InstanceThreads:
    def __init__(self, idle: int, name: str = "inferlet"):
        self.max_idle = idle
        self.name = name
        self.jobs: queue.SimpleQueue[tuple[Job, str] | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.idle = 0  # threads that will take the next job from `jobs` (or are taking it)
        self.closed = False
        for _ in range(idle):
            self._start(None)

    def run(self, job: Job, name: str) -> None:
        """Run `job` on a thread named `name` (the instance's, for debuggers and profilers)."""
        with self.lock:
            if self.closed:
                raise RuntimeError("the instance threads are closed")
            take_idle = self.idle > 0
            if take_idle:
                self.idle -= 1
        if take_idle:
            self.jobs.put((job, name))
        else:
            self._start((job, name))

    def waiting(self) -> int:
        """Threads waiting for a job (or started and about to)."""
        with self.lock:
            return self.idle

    def close(self) -> None:
        """End the waiting threads; threads running a job end when it does."""
        with self.lock:
            self.closed = True
            idle, self.idle = self.idle, 0
        for _ in range(idle):
            self.jobs.put(None)

    def _start(self, first: tuple[Job, str] | None) -> None:
        if first is None:
            with self.lock:
                self.idle += 1
        threading.Thread(target=self._work, args=(first,), name=f"{self.name}-idle", daemon=True).start()

    def _work(self, job: tuple[Job, str] | None) -> None:
        thread = threading.current_thread()
        while True:
            if job is None:
                job = self.jobs.get()
                if job is None:  # closed
                    return
            run, thread.name = job
            try:
                run()
            except Exception:  # a job's own bug must not take the thread's later jobs with it
                log.exception("a job on %s failed", thread.name)
            thread.name, job = f"{self.name}-idle", None
            with self.lock:
                if self.closed or self.idle >= self.max_idle:
                    return
                self.idle += 1
