"""InstanceThreads (pie/runtime/instance_threads.py): jobs run on threads started ahead;
a burst beyond the pool still runs; finished threads refill the pool up to its size."""

from __future__ import annotations

import threading
import time

from pie.runtime.instance_threads import InstanceThreads


def _until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


def test_jobs_run_on_the_waiting_threads_under_their_names():
    pool = InstanceThreads(3, name="t-a")
    try:
        assert _until(lambda: pool.waiting() == 3)
        before = threading.active_count()
        release, names, started = threading.Event(), [], threading.Semaphore(0)

        def job() -> None:
            names.append(threading.current_thread().name)
            started.release()
            release.wait()

        for i in range(3):
            pool.run(job, f"job-{i}")
        for _ in range(3):
            assert started.acquire(timeout=5)
        assert threading.active_count() == before  # no thread was started for them
        assert sorted(names) == ["job-0", "job-1", "job-2"]
        assert pool.waiting() == 0
        release.set()
        assert _until(lambda: pool.waiting() == 3)  # back in the pool, renamed idle
        assert all(t.name != "job-0" for t in threading.enumerate())
    finally:
        pool.close()


def test_a_burst_beyond_the_pool_runs_and_the_pool_keeps_its_size():
    pool = InstanceThreads(2, name="t-b")
    try:
        release, done = threading.Event(), []
        for i in range(5):
            pool.run(lambda i=i: (release.wait(), done.append(i)), f"job-{i}")
        release.set()
        assert _until(lambda: len(done) == 5)
        assert sorted(done) == list(range(5))
        assert _until(lambda: pool.waiting() == 2)
        time.sleep(0.05)
        assert pool.waiting() == 2  # the three extra threads ended
        assert sum(t.name == "t-b-idle" for t in threading.enumerate()) == 2
    finally:
        pool.close()


def test_a_failing_job_leaves_its_thread_serving():
    pool = InstanceThreads(1, name="t-c")
    try:
        def bad() -> None:
            raise ValueError("a bug in the job")

        ran = threading.Event()
        pool.run(bad, "bad")
        assert _until(lambda: pool.waiting() == 1)
        pool.run(ran.set, "good")
        assert ran.wait(5)
    finally:
        pool.close()


def test_close_ends_the_waiting_threads_and_refuses_jobs():
    pool = InstanceThreads(4, name="t-d")
    assert _until(lambda: pool.waiting() == 4)
    pool.close()
    assert _until(lambda: not any(t.name == "t-d-idle" for t in threading.enumerate()))
    try:
        pool.run(lambda: None, "late")
    except RuntimeError as e:
        assert "closed" in str(e)
    else:
        raise AssertionError("a job after close was accepted")


def test_no_pool_starts_a_thread_per_job():
    pool = InstanceThreads(0, name="t-e")
    ran = threading.Event()
    pool.run(ran.set, "only")
    assert ran.wait(5)
    assert _until(lambda: not any(t.name in ("only", "t-e-idle") for t in threading.enumerate()))
    pool.close()
