"""NOTE(gc-freeze): what start-up built is moved out of the collector's walk; later garbage is still collected."""

from __future__ import annotations

import gc

from sluice.obs.heap import freeze_startup_heap


def test_freeze_moves_startup_objects_out_of_the_collectors_generations_and_later_cycles_are_still_collected() -> None:
    class Node:
        def __init__(self) -> None:
            self.other: Node | None = None

    startup = Node()
    try:
        frozen = freeze_startup_heap("test")
        assert frozen == gc.get_freeze_count() > 0
        assert all(o is not startup for o in gc.get_objects()), "a frozen object is walked by no collection"
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle made after start-up
        del a, b
        assert gc.collect() >= 2, "garbage made after the freeze is still collected"
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0 and any(o is startup for o in gc.get_objects())
