"""Waits that end with the thing waited on, not after a set time (``kvtier.testing.services``):
a store is asked for as long as its process runs, so one that a loaded machine makes slow
(here: stopped for a while) still answers, and one that exited answers None at once."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from kvtier.testing.services import process_state, store_leases, store_stats

from support.helpers import start_store_process


def test_process_state_tells_running_stopped_and_gone(run_dir: Path) -> None:
    store = start_store_process(run_dir)
    try:
        assert process_state(store.pid) == "running"
        os.kill(store.pid, signal.SIGSTOP)
        while process_state(store.pid) != "stopped":  # delivered asynchronously
            time.sleep(0.01)
        os.kill(store.pid, signal.SIGCONT)
        store.proc.kill()
        store.proc.wait()
        assert process_state(store.pid) == "gone"
    finally:
        store.stop()


def test_a_slow_store_is_waited_for_and_a_gone_one_is_not(run_dir: Path) -> None:
    store = start_store_process(run_dir)
    resume = threading.Timer(2.0, os.kill, (store.pid, signal.SIGCONT))
    try:
        os.kill(store.pid, signal.SIGSTOP)  # answers nothing until continued
        resume.start()
        started = time.monotonic()
        stats = store_stats(store.address, store.pid)
        assert stats is not None and time.monotonic() - started >= 1.5
        assert store_leases(store.address, store.pid) == 0
        store.proc.kill()
        store.proc.wait()  # reaped: its pid is gone
        started = time.monotonic()
        assert store_stats(store.address, store.pid) is None
        assert store_leases(store.address, store.pid) == 0
        assert time.monotonic() - started < 5  # no waiting on a store that exited
    finally:
        resume.cancel()
        store.stop()
