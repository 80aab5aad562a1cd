"""While a run lasts the cyclic collector runs its young generation every 20,000 allocations (Python's
700 before and after); ``gym-ray run`` also freezes what start-up built, a worker actor does not."""

from __future__ import annotations

import gc

import pytest

from gym_ray.run._gc import RUN_GC_THRESHOLD, collecting_rarely


def test_the_threshold_holds_inside_the_block_only_and_freezing_is_asked_for() -> None:
    before = gc.get_threshold()
    frozen = gc.get_freeze_count()
    with collecting_rarely(freeze=False):
        assert gc.get_threshold() == (RUN_GC_THRESHOLD, *before[1:])
        assert gc.get_freeze_count() == frozen
    assert gc.get_threshold() == before
    with pytest.raises(RuntimeError, match="boom"), collecting_rarely(freeze=False):
        raise RuntimeError("boom")
    assert gc.get_threshold() == before  # put back after an error too
    assert RUN_GC_THRESHOLD == 20_000


def test_freezing_moves_what_exists_to_the_permanent_generation() -> None:
    marker = [object()]  # a new container, alive now: frozen on entry
    frozen = gc.get_freeze_count()
    try:
        with collecting_rarely():
            assert gc.get_freeze_count() > frozen
            assert gc.get_threshold()[0] == RUN_GC_THRESHOLD
            assert marker
    finally:
        gc.unfreeze()  # this test process goes on: give its objects back to the collector
