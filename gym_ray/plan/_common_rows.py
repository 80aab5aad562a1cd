"""The common input row, expanded without the general preprocessing path (planning speed).

Most inputs are flat rows read from a file that name their agent (``agent_ref.name``), carry a
``responses_create_params`` object and nothing that routes them elsewhere, and a run that sets none of the
knobs that rewrite rows (``agent_map``, ``fan_out``, a per-key ``num_repeats``, ``num_repeats_add_seed``,
``task_ids``, run-level ``responses_create_params``; routing mode ``agent``). For such a row every step of
:meth:`gym_ray.plan.preprocess._Preprocessor.expand` reduces to: number its task by content (or keep its own
``_ng_task_index``), copy it, and stamp the task and rollout indices. :class:`CommonRows` does just that,
with each field read once.

The general path stays the definition: :meth:`CommonRows.expand` returns None for any row it is not sure
of (not a dict, a ``task_id`` key, an environment stamp, an ``agent_ref`` that is not an object with a
non-empty string name, a ``_ng_task_index`` that is not an int >= 0, a row whose digest cannot be taken),
before it has changed any state, and the caller then runs the general path on it. Rows come out identical:
same keys in the same order, same values, same task and rollout numbers (``tests/plan`` compares both
paths' planned shard files byte for byte).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from gym_ray import keys
from gym_ray.plan._compact_index import DenseCounters

__all__ = ["ENABLED", "CommonRows"]

#: Whether preprocessing may take the common-row path (tests turn it off to get the general path alone).
ENABLED = True

_AGENT_REF = keys.AGENT_REF
_PARAMS = keys.RESPONSES_CREATE_PARAMS
_TASK_ID = keys.TASK_ID
_ENV = keys.ENVIRONMENT_SERVER
_TASK = keys.TASK_INDEX
_ROLLOUT = keys.ROLLOUT_INDEX


class CommonRows:
    """Expands common rows exactly as the general preprocessing path would, sharing its state.

    Args:
        num_repeats: Copies per row (the run's integer ``num_repeats``).
        task_index: The pass's content numbering (digest of the row -> task index); may raise
            ``TypeError`` / ``ValueError`` for a row it cannot digest, before numbering anything.
        next_rollout: The pass's per-task rollout counters.
        keys_seen: The pass's set of routing keys seen (the agent name is added, as the general path does).
    """

    __slots__ = ("_keys_seen", "_num_repeats", "_take", "_task_index")

    def __init__(
        self,
        *,
        num_repeats: int,
        task_index: Callable[[Mapping[str, Any]], int],
        next_rollout: DenseCounters,
        keys_seen: set[str],
    ) -> None:
        self._num_repeats = num_repeats
        self._task_index = task_index
        self._take = next_rollout.take
        self._keys_seen = keys_seen

    @property
    def num_repeats(self) -> int:
        """Copies per row."""
        return self._num_repeats

    def number(self, row: Any) -> str | None:
        """Number ``row``'s task as :meth:`expand` would, building no rows and taking no rollout number
        (planning's validation pass); return its agent, or None (nothing numbered) as :meth:`expand`."""
        found = self._numbered(row)
        return None if found is None else found[1]

    def expand(self, row: Any) -> list[dict[str, Any]] | None:
        """The output rows of ``row``, or None (nothing changed) when the general path must expand it."""
        found = self._numbered(row)
        if found is None:
            return None
        task = found[0]
        base = dict(row)
        base[_PARAMS] = dict(row[_PARAMS])  # the run-level overrides (none) merged over the row's own
        base[_TASK] = task
        take = self._take
        if self._num_repeats == 1:
            base[_ROLLOUT] = take(task)
            return [base]
        out = []
        for _ in range(self._num_repeats):
            item = dict(base)
            item[_ROLLOUT] = take(task)
            out.append(item)
        return out

    def _numbered(self, row: Any) -> tuple[int, str] | None:
        """``(task index, agent)`` of a common row, its task numbered; None (nothing done) for another."""
        if type(row) is not dict or _TASK_ID in row or _ENV in row:
            return None
        ref = row.get(_AGENT_REF)
        if type(row.get(_PARAMS)) is not dict or type(ref) is not dict:
            return None
        agent = ref.get("name")
        if type(agent) is not str or not agent:
            return None
        task = row.get(_TASK)
        if task is None:
            try:
                task = self._task_index(row)
            except (TypeError, ValueError):
                return None  # the general path reports the row
        elif type(task) is not int or task < 0:
            return None
        self._keys_seen.add(agent)
        return task, agent
