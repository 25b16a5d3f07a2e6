"""Threads started ahead of the instances that will run on them (`InstanceThreads`).

Each instance runs on a thread of its own (pie/runtime/runtime.py). Starting that thread in
`launch` made the launcher wait in `Thread.start()` until the new thread had been scheduled
and had taken the GIL: with 128 instances launched at once over one RPC connection (Table
5's workload) and the first ones already decoding, that wait was 3.0 ms median, 5.8 ms p90,
per launch, 383 of the 439 ms the server spent on those 128 launch requests (Zen 4, 2
vCPUs, /tmp probe of 2026-12-08), so the last instance started ~0.6 s after the first.

Here `runtime.idle_threads` threads are started with the runtime and wait on a queue;
`run` queues the job for one and returns at once. A thread whose instance ended goes back
to waiting while fewer than that many wait, else it ends. With none waiting, a spawner
thread starts one for the job: a burst beyond the pool starts its instances as late as
before, but `run` still does not wait (it is called on the server's event loop). Idle
threads cost no CPU (blocked on the queue) and little memory (their stacks are reserved,
not touched): 128 took ~2 MB resident and ~0.14 s to start.
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
        self.idle = idle  # threads that will take the next job from `jobs` (or are taking it)
        self.alive = 0  # threads started and not ended
        self.closed = False
        self.wanted = threading.Semaphore(0)  # one release per thread the spawner is to start
        threading.Thread(target=self._spawn, name=f"{name}-spawner", daemon=True).start()
        for _ in range(idle):
            self._start()

    def run(self, job: Job, name: str) -> None:
        """Run `job` on a thread named `name` (the instance's, for debuggers and profilers)."""
        with self.lock:
            if self.closed:
                raise RuntimeError("the instance threads are closed")
            spawn = self.idle == 0
            if not spawn:
                self.idle -= 1
        self.jobs.put((job, name))
        if spawn:
            self.wanted.release()

    def waiting(self) -> int:
        """Threads waiting for a job (or started and about to)."""
        with self.lock:
            return self.idle

    def close(self) -> None:
        """End the waiting threads; threads running a job end when it does."""
        with self.lock:
            self.closed, self.idle, alive = True, 0, self.alive
        for _ in range(alive):  # one for each that may wait; a busy one ends without taking it
            self.jobs.put(None)
        self.wanted.release()  # the spawner sees `closed` and ends

    def _start(self) -> None:
        with self.lock:
            self.alive += 1
        threading.Thread(target=self._work, name=f"{self.name}-idle", daemon=True).start()

    def _spawn(self) -> None:
        while True:
            self.wanted.acquire()
            if self.closed:
                return
            self._start()  # it takes the job `run` queued (or an earlier one: any will do)

    def _work(self) -> None:
        try:
            self._serve(threading.current_thread())
        finally:
            with self.lock:
                self.alive -= 1

    def _serve(self, thread: threading.Thread) -> None:
        while True:
            job = self.jobs.get()
            if job is None:  # closed
                return
            run, thread.name = job
            try:
                run()
            except Exception:  # a job's own bug must not take the thread's later jobs with it
                log.exception("a job on %s failed", thread.name)
            thread.name = f"{self.name}-idle"
            with self.lock:
                if self.closed or self.idle >= self.max_idle:
                    return
                self.idle += 1
