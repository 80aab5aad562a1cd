"""Where a run's Ray lives and where its actors go.

- :func:`ray_connection` / :func:`start_quiet_ray` / :func:`start_ray` / :func:`ray_init_kwargs`: use the
  Ray this process runs,
  join ``address`` / ``RAY_ADDRESS``, else start a lean local Ray of our own (``address="local"``: never
  silently join another cluster that happens to run on this machine, e.g. one started by ``ray start``
  or a test's multi-node cluster); quiet (Ray's start-up lines and the actors' logs are not printed), a
  failed start is one line, and Python's SIGTERM handler is put back after Ray's. :func:`import_ray`
  imports Ray without the note its first import logs in a Jupyter kernel.
- :class:`WorkerPlacement` puts worker actors on the nodes that offer CPUs (a head started with
  ``num-cpus=0``, as KubeRay recommends, is left alone), the node with the fewest of the run's live
  workers first, so workers spread by construction and a lost node's replacements go to the others.
  The affinity is hard (Ray's soft affinity was seen placing actors elsewhere while the chosen node had
  room): a worker whose node is gone before it starts fails to start and is replaced like a lost one.
- :func:`pinned_to_caller` keeps the run's control actors (the driver and the coordinator) on the caller's
  node (usually the head), whose loss ends the run anyway.

What a local Ray costs (Ray 2.60, read from ``ray/_private/node.py`` and ``services.py``): ``ray.init``
starts the GCS, the raylet (which starts its dashboard agent and runtime-env agent), the API server
(``dashboard.py``, with ``include_dashboard=False`` only its usage-stats module; ``ray.init`` waits until
it has started), the autoscaler monitor and the log monitor. ``ray.init`` has no public switch for the
last three, but its head's node parameters have one for two of them (``no_monitor``,
``include_log_monitor``) and its ``Node`` starts the API server in one method: :func:`start_ray` sets
the first and skips the second while ``ray.init`` builds a local head of our own, so a local run's tree
is 4 Ray processes, the caller and the ``1 + num_workers`` actor processes (three processes fewer;
``gym-ray bench ray-vs-local``). Also ours to choose: no dashboard (``include_dashboard=False``), no
log forwarding (``log_to_driver=False``), no prestarted worker processes (:data:`NO_PRESTART`: the
processes are the run's actors, started when it asks for them), and the logical CPU count
(:data:`LOCAL_MAX_CPUS`). The object store is left at Ray's default size: it is reserved, not resident
(a run ships only small specs and reports through it, and rows passed as a list once).

Every actor asks for ``num_cpus=0``: they wait on the network, and a CPU request would make a small
cluster refuse to schedule them.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import signal
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from gym_ray.errors import ConfigError, GymRayError

#: Upper bound of the default worker count (one worker drives hundreds of rollouts at once).
MAX_DEFAULT_WORKERS = 16
#: Logical CPUs of a local Ray started for a run: the default workers and the run's host actor.
LOCAL_MAX_CPUS = MAX_DEFAULT_WORKERS + 1

__all__ = [
    "LOCAL_MAX_CPUS",
    "MAX_DEFAULT_WORKERS",
    "QUIET_RAY",
    "WorkerPlacement",
    "current_node_id",
    "default_num_workers",
    "import_ray",
    "pinned_to_caller",
    "ray_connection",
    "ray_init_kwargs",
    "start_quiet_ray",
    "start_ray",
]

#: ``ray.init`` options of a Ray gym_ray starts or joins: Ray's own start-up lines (its SIGTERM handler,
#: token authentication, "Started a local Ray instance") and the actors' log lines (forwarded with ANSI
#: colour prefixes) are not printed; every error crosses as a typed exception and is reported once by the
#: caller. The actors' logs stay in Ray's session folder (/tmp/ray/session_latest/logs on the head node).
QUIET_RAY: dict[str, Any] = {"logging_level": logging.ERROR, "log_to_driver": False}


def import_ray() -> Any:
    """``import ray``, without the line Ray's first import logs in a Jupyter kernel.

    There Ray checks at import for ``ipywidgets`` (to render the value of ``ray.init`` as a widget) and
    logs "Missing packages: ['ipywidgets']" when it is absent; gym_ray never displays that value, so the
    check's logger is set to warnings before Ray is first imported. A no-op once Ray is imported.
    """
    if "ray" not in sys.modules:
        logging.getLogger("ray.widgets.util").setLevel(logging.WARNING)
    import ray

    return ray


def ray_init_kwargs(address: str | None) -> dict[str, Any]:
    """Keyword arguments of ``ray.init`` for a run: join ``address``, else start a local Ray.

    ``RAY_ADDRESS`` set in the environment counts as an address (Ray reads it itself). A local Ray offers
    ``min(cpu_count, MAX_DEFAULT_WORKERS + 1)`` logical CPUs (see :data:`LOCAL_MAX_CPUS`): gym_ray's actors
    ask for none; at most ``MAX_DEFAULT_WORKERS`` workers and the run's host actor run there.
    """
    if address is not None or os.environ.get("RAY_ADDRESS"):
        return {"address": address}
    cpus = min(os.cpu_count() or 1, LOCAL_MAX_CPUS)
    return {"address": "local", "num_cpus": cpus, "include_dashboard": False}


#: Head processes a run's own local Ray does without: the autoscaler monitor (nothing to scale on one
#: machine) and the log monitor (it only forwards actor logs to drivers, and runs start with
#: ``log_to_driver=False``). ``RayParams`` fields, set while ``ray.init`` builds its head node.
LEAN_HEAD_PARAMS: dict[str, Any] = {"no_monitor": True, "include_log_monitor": False}

#: The environment a run's own local Ray starts its processes with (a value the user set wins). Ray
#: prestarts one idle worker process per logical CPU when the first driver connects, and ``ray.init``
#: waits for them: 1.0-1.9 s on 2 cores (its ``connect`` takes 0.03 s without), and up to
#: :data:`LOCAL_MAX_CPUS` processes of ~1 s of CPU and ~50 MB each on a large machine, for a run that uses
#: ``1 + num_workers``. Without them each actor starts its process when the run creates it.
NO_PRESTART: dict[str, str] = {"RAY_prestart_worker_first_driver": "0"}


@contextmanager
def _environment_defaults(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` where unset, inside the block (processes started there inherit it)."""
    added = {name: value for name, value in values.items() if name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


@contextmanager
def _swapped(module: Any, name: str, make: Callable[[Any], Any]) -> Iterator[bool]:
    """``module.name`` replaced by ``make(original)`` inside the block (None from ``make``: left as is).

    Yields whether it was replaced; the original is always put back.
    """
    base = getattr(module, name)
    replacement = make(base)
    if replacement is None:
        yield False
        return
    setattr(module, name, replacement)
    try:
        yield True
    finally:
        setattr(module, name, base)


def _lean_params(base: Any) -> Any:
    """A ``RayParams`` whose defaults are :data:`LEAN_HEAD_PARAMS` (None when it lacks those fields)."""
    try:
        fields = inspect.signature(base).parameters
    except (TypeError, ValueError):
        return None
    if not all(name in fields for name in LEAN_HEAD_PARAMS):
        return None

    class LeanRayParams(base):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**LEAN_HEAD_PARAMS, **kwargs})

    return LeanRayParams


def _node_without_api_server(base: Any) -> Any:
    """A ``Node`` that starts no API server when the dashboard is off (None when Ray's ``Node`` differs).

    With ``include_dashboard=False`` Ray's API server loads only its usage-stats module, and ``ray.init``
    waits (polling every 0.1 s) until that process has started and registered its address: ~1-2 s of
    wall and a Python process (~100 MB RSS) for nothing a run uses. Ray treats a head without it as one
    whose dashboard failed to start: no ``webui_url``.
    """
    method = getattr(base, "start_api_server", None)
    try:
        params = inspect.signature(method).parameters if method is not None else {}
    except (TypeError, ValueError):
        return None
    if not {"include_dashboard", "raise_on_failure"} <= set(params):
        return None

    class NodeWithoutApiServer(base):  # type: ignore[misc]
        def start_api_server(self, *, include_dashboard: bool | None, raise_on_failure: bool) -> None:
            if include_dashboard is not False:
                super().start_api_server(
                    include_dashboard=include_dashboard, raise_on_failure=raise_on_failure
                )
                return
            self._webui_url = None

    return NodeWithoutApiServer


@contextmanager
def _lean_head() -> Iterator[tuple[bool, bool]]:
    """While ``ray.init`` starts a local head, start it without the processes a run never uses.

    Its processes start with :data:`NO_PRESTART` in their environment (Ray reads ``RAY_<setting>``).

    ``ray.init`` has no argument for them, but builds its head from two names of its own:
    ``ray._private.parameter.RayParams`` (its constructor takes :data:`LEAN_HEAD_PARAMS`) and
    ``ray._private.node.Node`` (whose ``start_api_server`` starts the API server). Each is swapped for a
    subclass until ``ray.init`` returns. Yields whether each swap could be made; a Ray whose names differ
    starts its usual head (the run works, with more processes).
    """
    try:
        from ray._private import node, parameter
    except ImportError:
        yield (False, False)
        return
    with (
        _environment_defaults(NO_PRESTART),
        _swapped(parameter, "RayParams", _lean_params) as params,
        _swapped(node, "Node", _node_without_api_server) as api,
    ):
        yield (params, api)


def start_ray(address: str | None, **options: Any) -> None:
    """``ray.init(**ray_init_kwargs(address), **options)``; a local Ray of our own starts lean.

    A local head started here has no autoscaler monitor and no log monitor (:data:`LEAN_HEAD_PARAMS`),
    and no API server (with the dashboard off it serves only usage stats, and ``ray.init`` waits 1-2 s
    for it to start): three Python processes (measured on Ray 2.60: the two monitors ~100 MB of PSS, ~1 s
    of CPU at start and ~2% of a core while idle) that a run on one machine never uses. Nor does it
    prestart idle worker processes (:data:`NO_PRESTART`). Joining a cluster changes nothing there.
    """
    import ray

    kwargs = {**ray_init_kwargs(address), **options}
    if kwargs.get("address") != "local":
        ray.init(**kwargs)
        return
    with _lean_head():
        ray.init(**kwargs)


def current_node_id() -> str:
    """The Ray node (hex id) this process runs on."""
    import ray

    node: str = ray.get_runtime_context().get_node_id()
    return node


def _affinity(node_id: str) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


def pinned_to_caller() -> dict[str, Any]:
    """Ray actor options that place an actor on the caller's node."""
    return {"num_cpus": 0, "scheduling_strategy": _affinity(current_node_id())}


#: How much of ``control_actors_resource`` each control actor asks for: any node holding the resource
#: takes both (and other runs' control actors).
CONTROL_RESOURCE_SHARE = 0.001


def control_actor_options(resource: str | None) -> dict[str, Any]:
    """Ray actor options of a run's driver and coordinator actors: the caller's node, or (``resource``)
    any node holding that custom Ray resource (a job submitter that is not a cluster node).

    Raises:
        ConfigError: No node of the cluster holds ``resource`` (the actors would wait forever).
    """
    if resource is None:
        return pinned_to_caller()
    import ray

    held: dict[str, float] = ray.cluster_resources()  # type: ignore[no-untyped-call]
    if held.get(resource, 0) < CONTROL_RESOURCE_SHARE:
        custom = sorted(k for k in held if k not in _RAY_BUILTIN and not k.startswith("node:"))
        raise ConfigError(
            f"control_actors_resource={resource!r}: no node of this Ray cluster holds that resource "
            f"(custom resources: {', '.join(custom) or 'none'}); give a node of the cluster the run joins "
            f"(--address / RAY_ADDRESS) that resource, `ray start --resources='{{\"{resource}\": 1}}'`, or "
            "leave the setting out to place the driver and the coordinator on this node"
        )
    return {"num_cpus": 0, "resources": {resource: CONTROL_RESOURCE_SHARE}}


_RAY_BUILTIN = frozenset({"CPU", "GPU", "memory", "object_store_memory", "accelerator_type"})


class WorkerPlacement:
    """Chooses a node for each new worker actor: a CPU node with the fewest of this run's live workers.

    Args:
        nodes: ``ray.nodes()``-shaped records (``NodeID``, ``Alive``, ``Resources``); read again on each
            :meth:`options` call when None.
    """

    def __init__(self, nodes: list[dict[str, Any]] | None = None) -> None:
        self._fixed = nodes
        self._where: dict[str, str] = {}

    def _candidates(self) -> list[str]:
        import ray

        nodes: list[dict[str, Any]] = self._fixed if self._fixed is not None else ray.nodes()  # type: ignore[no-untyped-call]
        alive = [n for n in nodes if n.get("Alive")]
        with_cpus = [n for n in alive if n.get("Resources", {}).get("CPU", 0) > 0]
        return [str(n["NodeID"]) for n in (with_cpus or alive)]

    def options(self, worker_id: str, live: set[str]) -> dict[str, Any]:
        """Ray actor options for worker ``worker_id``; ``live`` names the run's workers still alive."""
        candidates = self._candidates()
        if not candidates:
            return {"num_cpus": 0}
        load = Counter(node for worker, node in self._where.items() if worker in live)
        node = min(candidates, key=lambda n: (load[n], candidates.index(n)))
        self._where[worker_id] = node
        return {"num_cpus": 0, "scheduling_strategy": _affinity(node)}

    def worker_to_move(self, live: list[str]) -> str | None:
        """A worker to move when a node with CPUs has none of ``live`` and another node has two or more.

        Nodes join clusters mid-run (autoscaling, a repaired machine): moving one worker at a time from
        the most crowded node spreads the run over them. Returns the last started of that node's
        workers (``live`` is in start order), or None when the spread is already even enough.
        """
        candidates = self._candidates()
        load = Counter(self._where[w] for w in live if w in self._where)
        if not candidates or all(load[node] > 0 for node in candidates):
            return None
        crowded = max(load, key=lambda node: load[node], default=None)
        if crowded is None or load[crowded] < 2:
            return None
        return [w for w in live if self._where.get(w) == crowded][-1]

    def node_of(self, worker_id: str) -> str | None:
        """The node chosen for ``worker_id`` (hex id), or None."""
        return self._where.get(worker_id)


@asynccontextmanager
async def ray_connection(address: str | None) -> Any:
    """Use the Ray this process runs, join ``address``/``RAY_ADDRESS``, or start a local one."""
    ray = import_ray()
    if ray.is_initialized():
        yield ray
        return
    try:
        await start_quiet_ray(address)
    except Exception as exc:  # Ray raises bare Exception / RuntimeError / ConnectionError here
        where = (
            f"join the Ray cluster at {address or os.environ.get('RAY_ADDRESS')}"
            if address or os.environ.get("RAY_ADDRESS")
            else "start a local Ray"
        )
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise GymRayError(
            f"could not {where}: {text}; nothing was dispatched. Check the address or the machine's load, "
            "then rerun"
        ) from exc
    try:
        yield ray
    finally:
        ray.shutdown()


async def start_quiet_ray(address: str | None) -> None:
    """Start or join Ray as a run does: :func:`start_ray` in a thread with :data:`QUIET_RAY`, then
    Python's SIGTERM handler put back (Ray's own prints a stack dump and aborts).

    Raises:
        Exception: What ``ray.init`` raised (Ray raises bare ``Exception`` / ``RuntimeError`` /
            ``ConnectionError``); :func:`ray_connection` turns it into one line.
    """
    import_ray()
    await asyncio.to_thread(functools.partial(start_ray, address, **QUIET_RAY))
    _restore_sigterm()


def _restore_sigterm() -> None:
    """Give SIGTERM back to Python after ``ray.init``.

    Ray's core worker installs a C-level SIGTERM handler in the driver process that prints a stack dump and
    aborts; Python's own handler (e.g. the one :func:`gym_ray.run.signals.run_until_signal` set, which
    stops the run like Ctrl-C) still stands at the Python level, so re-installing it re-arms it.
    """
    import threading

    if threading.current_thread() is threading.main_thread():
        handler = signal.getsignal(signal.SIGTERM)
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)


def default_num_workers(ray_module: Any) -> int:
    cpus = int(ray_module.cluster_resources().get("CPU", 1))
    return max(1, min(MAX_DEFAULT_WORKERS, cpus))
