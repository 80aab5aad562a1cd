"""Where a run's Ray lives and where its actors go.

- :func:`ray_init_kwargs`: join ``address`` / ``RAY_ADDRESS``, else start a lean local Ray of our own
  (``address="local"``: never silently join another cluster that happens to run on this machine, e.g.
  one started by ``ray start`` or a test's multi-node cluster).
- :class:`WorkerPlacement` puts worker actors on the nodes that offer CPUs (a head started with
  ``num-cpus=0``, as KubeRay recommends, is left alone), the node with the fewest of the run's live
  workers first, so workers spread by construction and a lost node's replacements go to the others.
  The affinity is hard (Ray's soft affinity was seen placing actors elsewhere while the chosen node had
  room): a worker whose node is gone before it starts fails to start and is replaced like a lost one.
- :func:`pinned_to_caller` keeps the driver and the coordinator on the caller's node (usually the head),
  whose loss ends the run anyway.

Every actor asks for ``num_cpus=0``: they wait on the network, and a CPU request would make a small
cluster refuse to schedule them.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

__all__ = ["WorkerPlacement", "current_node_id", "pinned_to_caller", "ray_init_kwargs"]


def ray_init_kwargs(address: str | None) -> dict[str, Any]:
    """Keyword arguments of ``ray.init`` for a run: join ``address``, else start a local Ray.

    ``RAY_ADDRESS`` set in the environment counts as an address (Ray reads it itself).
    """
    if address is not None or os.environ.get("RAY_ADDRESS"):
        return {"address": address}
    return {"address": "local", "num_cpus": os.cpu_count() or 1, "include_dashboard": False}


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

    def node_of(self, worker_id: str) -> str | None:
        """The node chosen for ``worker_id`` (hex id), or None."""
        return self._where.get(worker_id)
