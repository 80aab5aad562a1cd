"""What this machine charges for memory never used before, measured before every ``gym-ray bench`` scenario.

On some virtual machines the host backs guest memory only when the guest first touches it. There each 4 KiB
page the kernel hands out for the first time costs a trip to the host: ~10 us here on a fresh VM of the CI
class, against ~1.3 us (the fault and the zeroing) for a page touched before and handed out again.
Everything that grows memory pays it: page cache for written files, Python heaps, new processes. December 2
on such a VM, writing 316 MB to a new file took 0.78-0.82 s of CPU on fresh pages and 0.06 s once the VM's
memory had been touched once, and the merge benchmark went from 510k to 1.26-1.30M lines/s. Such a cost
belongs to the machine, not to the code measured, so each bench run measures it first
(:func:`fresh_memory_us_per_page`), reports it in its figures (``"machine"``) and warns on stderr when it is
high (:func:`fresh_memory_note`).

The probe maps fresh anonymous memory and writes one byte per page. The kernel may serve it from pages
touched before while pages never touched remain elsewhere, so a low figure says the probe's pages were
cheap, a high one that the machine still hands out fresh pages at that cost.
"""

from __future__ import annotations

import mmap
import subprocess
import sys
import time

__all__ = ["PROBE_MB", "SLOW_US_PER_PAGE", "fresh_memory_note", "fresh_memory_us_per_page", "machine_figures"]

#: Memory the probe touches.
PROBE_MB = 256
#: Above this cost per page, the bench warns that its figures include first-touch costs.
SLOW_US_PER_PAGE = 3.0
_PAGE = mmap.PAGESIZE


def fresh_memory_us_per_page(mb: int = PROBE_MB) -> float:
    """Microseconds of wall time to touch one page of ``mb`` MiB of freshly mapped anonymous memory."""
    size = mb << 20
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        started = time.perf_counter()
        for offset in range(0, size, _PAGE):
            memory[offset] = 1
        elapsed = time.perf_counter() - started
    finally:
        memory.close()
    return elapsed / (size // _PAGE) * 1e6


def fresh_memory_note(us_per_page: float) -> str | None:
    """The warning a bench prints for a first-touch cost of ``us_per_page``, or None when it is low."""
    if us_per_page <= SLOW_US_PER_PAGE:
        return None
    return (
        f"gym-ray bench: memory never used before costs {us_per_page:.1f} us per {_PAGE // 1024} KiB page "
        f"on this machine (a virtual machine whose host backs memory on first use; above "
        f"{SLOW_US_PER_PAGE:g} us is slow): the figures below include it and can be several times a warm "
        "machine's. Touching the free memory once first (docs/benchmarks.md#fresh-memory) removes it"
    )


def machine_figures() -> dict[str, float | None]:
    """The ``"machine"`` entry of a bench result, probed in a child process: touching the probe's memory in
    the bench's own process would raise its peak RSS (``VmHWM``, which a forked child inherits) and so
    every memory figure measured after it. None when the probe could not run (e.g. no 256 MiB to map)."""
    probe = "from gym_ray.bench import machine; print(machine.fresh_memory_us_per_page())"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    try:
        cost: float | None = round(float(done.stdout), 3) if done.returncode == 0 else None
    except ValueError:
        cost = None
    return {"fresh_memory_us_per_page": cost}
