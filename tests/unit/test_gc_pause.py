"""The writer's pause of the garbage collector leaves it as it found it, also when writes overlap."""

from __future__ import annotations

import gc
import os
import threading

import pytest

from lowdiff._persist.gc_pause import collector_paused


@pytest.fixture(autouse=True)
def restore_gc():
    was = gc.isenabled()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_paused_inside_and_enabled_after() -> None:
    gc.enable()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer write is still going on
    assert gc.isenabled()


def test_a_collector_disabled_before_stays_disabled() -> None:
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()


def test_resumed_after_an_exception_and_by_the_last_of_overlapping_threads() -> None:
    gc.enable()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("write failed")
    assert gc.isenabled()
    inside, release = threading.Event(), threading.Event()

    def other_write() -> None:
        with collector_paused():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other_write)
    t.start()
    assert inside.wait(10)
    with collector_paused():
        pass
    assert not gc.isenabled()  # the other thread's write is not over
    release.set()
    t.join(10)
    assert gc.isenabled()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_process_forked_during_a_write_collects_garbage() -> None:
    """A DataLoader worker forked while the writer thread writes has no writer thread to end the pause: it starts
    with the collector as it was before the write, can pause it again itself (a fresh lock), and leaving the write
    it was forked in changes nothing."""
    gc.enable()
    ok = False
    try:
        with collector_paused():
            pid = os.fork()
            if pid == 0:
                ok = gc.isenabled()
                with collector_paused():
                    ok = ok and not gc.isenabled()
                ok = ok and gc.isenabled()
        if pid == 0:
            ok = ok and gc.isenabled()
            with collector_paused():
                ok = ok and not gc.isenabled()
            ok = ok and gc.isenabled()
    finally:
        if pid == 0:  # the child reports through its exit status and never returns into pytest
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert gc.isenabled()
