"""Blocking entry points stop on SIGTERM as they stop on Ctrl-C.

``asyncio.run`` turns Ctrl-C (SIGINT) into a cancellation of the main task (its ``finally`` blocks run:
actors are stopped, writers closed) and then raises ``KeyboardInterrupt``. A batch scheduler (Slurm,
Kubernetes) stops a job with SIGTERM instead, whose default action kills the process on the spot.
:func:`run_until_signal` gives SIGTERM the same path: the main task is cancelled, joined, and
:class:`~gym_ray.errors.RunTerminated` (a ``KeyboardInterrupt``) is raised once it has finished.

The SIGTERM handler is installed for the duration of the call only, and only in the main thread (Python
delivers signals there); elsewhere the call is plain ``asyncio.run``. Both SIGTERM and Ctrl-C are noted
(:func:`gym_ray.record.run_state.note_stop_signal`) before the main task is cancelled, so the run folder's
state file says which one stopped the run.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from gym_ray.errors import RunTerminated
from gym_ray.record.run_state import note_stop_signal

__all__ = ["run_until_signal"]

T = TypeVar("T")


def run_until_signal(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, with SIGTERM handled like Ctrl-C.

    Args:
        main: The coroutine to run to completion.

    Returns:
        Its result.

    Raises:
        RunTerminated: SIGTERM arrived; ``main`` was cancelled and has finished its cleanup.
        KeyboardInterrupt: Ctrl-C (``asyncio.run``'s own handling).
    """
    if threading.current_thread() is not threading.main_thread():
        return asyncio.run(main)
    note_stop_signal(None)
    terminated = threading.Event()
    outcome = asyncio.run(_cancel_on_sigterm(main, terminated))
    if terminated.is_set():
        raise RunTerminated("SIGTERM")
    return outcome  # type: ignore[return-value]


async def _cancel_on_sigterm(main: Coroutine[Any, Any, T], terminated: threading.Event) -> T | None:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None

    def on_sigterm() -> None:
        if not terminated.is_set():
            note_stop_signal("SIGTERM")
            terminated.set()
            task.cancel()

    # asyncio.run's own Ctrl-C handler cancels the main task; note the signal first, then let it act.
    on_sigint = signal.getsignal(signal.SIGINT)

    def noting_sigint(signum: int, frame: Any) -> None:
        note_stop_signal("SIGINT")
        if callable(on_sigint):
            on_sigint(signum, frame)

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    if callable(on_sigint):
        signal.signal(signal.SIGINT, noting_sigint)
    try:
        return await main
    except asyncio.CancelledError:
        if not terminated.is_set():
            raise  # someone else's cancellation (Ctrl-C): let asyncio.run report it
        task.uncancel()
        return None  # our own cancellation, turned into RunTerminated by the caller
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        if callable(on_sigint) and signal.getsignal(signal.SIGINT) is noting_sigint:
            signal.signal(signal.SIGINT, on_sigint)
