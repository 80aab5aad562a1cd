"""Helper processes (``spawn``) that do not run the parent's main script again.

A spawned child imports its parent's ``__main__`` (as ``__mp_main__``) before it unpickles its target,
so that functions defined in the main script resolve. gym_ray starts helper processes (the merge's
shard-sorting pool, planning's byte-range process) with functions of its own modules as targets, which
need nothing from the main script. What that import costs depends on who the parent is: in a Ray actor
the main script is Ray's ``default_worker.py``, and a spawned child imports Ray itself before its first
instruction of work (1.05-1.11 s of CPU and 3.6-6.2 s of wall per child on 2 busy cores, against
0.09-0.14 s and 0.1-0.9 s without; Ray 2.60). In a user's script that has no
``if __name__ == "__main__":`` guard, it would run the script's top level again.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["main_script_not_rerun"]

_HIDDEN = ("__file__", "__spec__")
_lock = threading.RLock()


@contextmanager
def main_script_not_rerun() -> Iterator[None]:
    """While the block lasts, ``spawn`` processes started in it do not import this process's ``__main__``.

    Inside the block ``__main__`` has no ``__file__`` and its ``__spec__`` is None, which is how
    multiprocessing sees an interactive session: it then tells the child to import nothing of it. Both
    are put back when the block ends. A pool that starts its processes on demand must be used inside the
    block. Blocks in several threads run one at a time (the attributes are process-wide).
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    with _lock:
        saved = {name: main.__dict__[name] for name in _HIDDEN if name in main.__dict__}
        main.__dict__.pop("__file__", None)
        main.__dict__["__spec__"] = None
        try:
            yield
        finally:
            for name in _HIDDEN:
                main.__dict__.pop(name, None)
            main.__dict__.update(saved)
