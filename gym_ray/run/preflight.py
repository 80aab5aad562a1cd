"""Checks before a run starts: everything knowable before dispatch is refused before Ray starts.

:func:`preflight` runs at the edge of every whole-config run (:func:`gym_ray.collect` /
:func:`gym_ray.acollect` before Ray is started or joined, :func:`gym_ray.acollect_local` before it plans),
on the :class:`~gym_ray.config.run_config.RunConfig` the edge built. It takes well under a second when the
servers answer (a refused connection is immediate; an address that drops packets costs at most
``PROBE_TIMEOUT_S``) and checks, in this order:

1. the worker count (``num_workers >= 1`` when given; ``0`` is refused, never taken as "the default");
2. the input: ``input_jsonl_fpath`` is set (or rows were passed), is a readable file, and holds at least
   one non-blank byte (rows passed as a list must not be empty);
3. ``output_dir``: not a file, inside a folder this process may write, and (for a new run) with free
   space for the materialized inputs (input bytes x rollouts per input row, a lower bound);
4. with the ``health_check`` setting (default on; ``--no-health-check``): every environment server of the
   config has a real port (0 means "any free port" to a server being started, never an address) and answers
   ``GET /`` with a status below 500 (NeMo Gym's and the reference servers' liveness route).

Each refusal is one :class:`~gym_ray.errors.GymRayError` whose message names the key, file, folder or
server instance and URL at fault and what to do. Row validation stays in planning (it reads every row).
Nothing here writes to disk or sends anything but ``GET /``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Iterable, Mapping, Sized
from pathlib import Path
from typing import Any

import aiohttp

from gym_ray.config.run_config import RunConfig
from gym_ray.config.settings import RunSettings
from gym_ray.config.topology import Topology
from gym_ray.errors import (
    ConfigError,
    InputError,
    ServerConnectionError,
    ServerHTTPError,
    UsageError,
)
from gym_ray.plan.run_manifest import RUN_MANIFEST

__all__ = [
    "PLANNING_NOTE_BYTES",
    "PROBE_TIMEOUT_S",
    "check_input",
    "check_output_dir",
    "check_ports",
    "check_servers",
    "check_workers",
    "preflight",
]

#: Seconds one health probe may take (connect + answer) before its server counts as unreachable.
PROBE_TIMEOUT_S = 5.0
#: Servers probed at once.
_PROBES_AT_ONCE = 16
_SKIP_HINT = "(or skip this check: --no-health-check / health_check=false)"


async def preflight(
    run: RunConfig,
    *,
    rows: Iterable[Mapping[str, Any]] | None = None,
    num_workers: int | None = None,
) -> None:
    """Refuse a run that cannot work, before anything starts (no Ray, nothing written or dispatched).

    Args:
        run: The run's config, as the edge resolved it.
        rows: The rows passed instead of ``input_jsonl_fpath``, if any (only a sized collection is
            checked for emptiness).
        num_workers: The worker count the caller asked for, if any.

    Raises:
        UsageError: ``num_workers < 1``.
        ConfigError: ``output_dir`` or ``input_jsonl_fpath`` unset; ``output_dir`` a file, not writable, or
            without space for the materialized inputs; an environment server on port 0.
        InputError: The input file is missing, unreadable or empty, or ``rows`` is empty.
        ServerConnectionError / ServerHTTPError: An environment server is unreachable or unhealthy.
    """
    check_workers(num_workers)
    check_input(run.settings, rows)
    check_output_dir(run.settings)
    check_ports(run.topology)
    if run.settings.health_check:
        await check_servers(run.topology)


def check_workers(num_workers: int | None, *, name: str = "num_workers") -> None:
    """Refuse a worker count below 1 (``None`` = choose automatically).

    Raises:
        UsageError: ``num_workers`` is given and below 1.
    """
    if num_workers is not None and (isinstance(num_workers, bool) or num_workers < 1):
        raise UsageError(
            f"{name} is {num_workers!r}: a run needs at least 1 worker; pass {name} >= 1, "
            "or leave it out to use one worker per CPU (at most 16)"
        )


def check_input(settings: RunSettings, rows: Iterable[Mapping[str, Any]] | None = None) -> None:
    """Refuse a run without input: ``input_jsonl_fpath`` unset, unreadable or empty, or an empty list.

    Raises:
        ConfigError: Neither rows nor ``input_jsonl_fpath``.
        InputError: The file is missing, a folder, unreadable or holds no rows; or ``rows`` is empty.
    """
    if rows is not None:
        if isinstance(rows, Sized) and len(rows) == 0:
            raise InputError("no input rows: the rows passed are an empty collection; pass at least one row")
        return
    path = settings.input_jsonl_fpath
    if path is None:
        raise ConfigError(
            "config key 'input_jsonl_fpath' is not set and no rows were passed: pass "
            "+input_jsonl_fpath=rows.jsonl (or rows=[...] from Python)",
            key="input_jsonl_fpath",
        )
    where = f"input file '{path}' (input_jsonl_fpath)"
    if os.path.isdir(path):
        raise InputError(f"{where} is a folder; pass a JSONL file with one task per line", path=path)
    try:
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 16):
                if chunk.strip():
                    return
    except FileNotFoundError:
        raise InputError(f"{where} does not exist; check the path", path=path) from None
    except OSError as exc:
        raise InputError(
            f"{where} cannot be read: {exc.strerror or exc}; check its permissions", path=path
        ) from exc
    raise InputError(
        f"{where} is empty: it holds no rows; pass a JSONL file with one task per line", path=path
    )


def check_output_dir(settings: RunSettings) -> None:
    """Refuse an ``output_dir`` that cannot hold the run: unset, a file, not writable, or too little space.

    The space check applies to a new run folder only (a resumed one holds its materialized inputs):
    free bytes must cover the input file's size times the rollouts each input row becomes (the largest
    ``num_repeats`` times the longest ``fan_out`` list), a lower bound of what planning writes.

    Raises:
        ConfigError: ``output_dir`` is not set, is a file or lies under one, is not writable, or lacks
            space (``key`` is ``output_dir``).
    """
    if settings.output_dir is None:
        raise ConfigError(
            "config key 'output_dir' is not set: a run needs a run folder; pass +output_dir=runs/r1",
            key="output_dir",
        )
    folder = Path(settings.output_dir)
    where = f"output_dir '{folder}'"
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == folder else f"lies under '{existing}', which is a file"
        raise ConfigError(
            f"{where} {what}; pass a folder path (a new one, or a run folder to resume)", key="output_dir"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        target = "it" if existing == folder else f"'{existing}'"
        raise ConfigError(
            f"{where} is not writable by this user ({target} denies it); pass a folder you can write to",
            key="output_dir",
        )
    if (folder / RUN_MANIFEST).exists() or settings.input_jsonl_fpath is None:
        return
    try:
        input_bytes = os.path.getsize(settings.input_jsonl_fpath)
    except OSError:
        return  # check_input reports it
    per_row = _rollouts_per_row(settings)
    needed = input_bytes * per_row
    free = shutil.disk_usage(existing).free
    if free < needed:
        raise ConfigError(
            f"{where} has {_size(free)} free on its file system; the run's materialized inputs need at "
            f"least {_size(needed)} ({_size(input_bytes)} of input x {per_row} rollouts per row); "
            "free some space or pass an output_dir on a larger disk",
            key="output_dir",
        )


def _rollouts_per_row(settings: RunSettings) -> int:
    repeats = settings.num_repeats
    most = max(repeats.values()) if isinstance(repeats, dict) else repeats
    fan = max((len(agents) for agents in (settings.fan_out or {}).values()), default=1)
    return most * fan


def _size(num_bytes: int) -> str:
    if num_bytes < 1 << 20:
        return f"{num_bytes / 1024:.1f} KiB"
    if num_bytes < 1 << 30:
        return f"{num_bytes / (1 << 20):.1f} MiB"
    return f"{num_bytes / (1 << 30):.1f} GiB"


#: Smallest input file whose reading is announced on stderr when progress is shown (it takes seconds).
PLANNING_NOTE_BYTES = 16 << 20


def planning_note(settings: RunSettings, *, before_ray: bool) -> str | None:
    """The line shown before a large input file is read and validated (``before_ray``: ahead of Ray's
    start), so a run is not silent for the seconds or minutes this takes; None for a smaller file or rows
    passed from Python."""
    path = settings.input_jsonl_fpath
    if path is None:
        return None
    try:
        size = os.path.getsize(path)
    except OSError:
        return None
    if size < PLANNING_NOTE_BYTES:
        return None
    when = "before Ray starts" if before_ray else "before the first rollout is sent"
    return f"gym-ray: reading and validating {_size(size)} of input rows ({path}) {when}"


def check_ports(topology: Topology) -> None:
    """Refuse an environment server whose port is 0 (checked with or without ``health_check``).

    Raises:
        ConfigError: The first such server, named with its URL (``key`` is ``<instance>.port``).
    """
    for name in topology.environment_servers():
        if topology.instances[name].port == 0:
            raise ConfigError(
                f"environment server '{name}' has port 0 ({topology.url_of(name)}): 0 means 'any free port' "
                "to a server being started, not an address to send rollouts to; point the run at the "
                "running servers (the run config `gym-ray serve` writes, or their real host:port)",
                key=f"{name}.port",
            )


async def check_servers(topology: Topology, *, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Refuse a run whose environment servers cannot be reached: port 0, no answer, or a 5xx to ``GET /``.

    Every environment server of the topology is checked (rows can route to any of them). A status below
    500 counts as healthy (a server without a ``/`` route answers 404: it is up).

    Raises:
        ConfigError: An environment server's port is 0 (names the instance and URL).
        ServerConnectionError: One does not accept a connection or answer within ``timeout_s``.
        ServerHTTPError: One answers ``GET /`` with a 5xx status.
    """
    check_ports(topology)
    names = topology.environment_servers()
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for start in range(0, len(names), _PROBES_AT_ONCE):
            # Every address first: one that is missing raises before any probe coroutine exists.
            batch = [(name, topology.url_of(name)) for name in names[start : start + _PROBES_AT_ONCE]]
            outcomes = await asyncio.gather(
                *(_probe(session, name, url, timeout_s) for name, url in batch),
                return_exceptions=True,
            )
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome


async def _probe(session: aiohttp.ClientSession, name: str, url: str, timeout_s: float) -> None:
    try:
        async with session.get(url + "/") as reply:
            status = reply.status
            excerpt = (await reply.text(errors="replace"))[:120]
    except TimeoutError:
        raise ServerConnectionError(
            f"environment server '{name}' at {url} did not answer GET / within {timeout_s:g} s; check that "
            f"it runs and that this machine can reach it {_SKIP_HINT}",
            url=url,
        ) from None
    except aiohttp.ClientError as exc:
        reason = getattr(exc, "os_error", None)
        errno = getattr(reason, "errno", None)
        text = os.strerror(errno) if errno else str(exc) or type(exc).__name__
        raise ServerConnectionError(
            f"environment server '{name}' at {url} is not reachable ({text}); start it (gym-ray serve "
            f"CONFIG) or fix its host/port in the config {_SKIP_HINT}",
            url=url,
        ) from None
    if status >= 500:
        raise ServerHTTPError(
            f"environment server '{name}' at {url} is unhealthy: GET / answered HTTP {status}; wait until "
            f"it is ready or fix it {_SKIP_HINT}",
            url=url,
            status=status,
            body_excerpt=excerpt,
        )
