"""harness/base/interrupts.py: a signal's exception inside an atomic section waits for its end, and never outlives
it."""

from __future__ import annotations

import threading

import pytest

from fedharness.base.interrupts import atomic, interrupt


class Stop(KeyboardInterrupt):
    pass


def test_an_interrupt_inside_waits_for_the_section_to_end_outside_it_is_raised_at_once():
    done = []
    with pytest.raises(Stop):
        with atomic():
            with atomic():  # nested: the outermost end raises it
                interrupt(Stop())
                done.append("inner")
            done.append("outer")
    assert done == ["inner", "outer"]
    with pytest.raises(Stop):
        interrupt(Stop())


def test_the_bodys_own_exception_wins_and_the_interrupt_is_not_left_for_a_later_section():
    with pytest.raises(ValueError):
        with atomic():
            interrupt(Stop())
            raise ValueError("the body's")
    with atomic():  # nothing stale raised here
        pass


def test_outside_the_main_thread_a_section_defers_nothing():
    depth_seen = []

    def body():
        with atomic():
            try:
                interrupt(Stop())
            except Stop:
                depth_seen.append("raised at once")

    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    assert depth_seen == ["raised at once"]
