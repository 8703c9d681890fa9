"""The writer's pause of the garbage collector leaves it as it found it, also when writes overlap."""

from __future__ import annotations

import gc
import threading

import pytest

from lowdiff.gc_pause import collector_paused


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
