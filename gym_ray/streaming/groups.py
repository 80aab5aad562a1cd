"""Rollout groups and policy versions: what a stream hands out, and how stale it is.

Every rollout a :class:`~gym_ray.streaming.stream.RolloutStream` delivers was admitted under a policy
version (an int the trainer advances with ``set_policy_version``); the version is stamped on the delivered
row and on the result as ``_ng_policy_version``. A :class:`RolloutGroup` is one task's rollouts, delivered
together, and knows the oldest and newest version among them.

Staleness of a rollout = current version - its version. With ``max_staleness=k`` a rollout is *stale*
when its staleness exceeds ``k``.
"""

from __future__ import annotations

import math
from typing import Any

from gym_ray import keys
from gym_ray.dispatch.outcomes import RolloutFailureRecord
from gym_ray.streaming.worker import Outcome

__all__ = ["Item", "RolloutGroup", "Row", "is_stale", "version_of"]

Row = dict[str, Any]
Item = tuple[Row, Outcome]


def version_of(item: Item) -> int:
    """The policy version a delivered ``(row, outcome)`` pair was admitted under."""
    return int(item[0][keys.POLICY_VERSION])


def is_stale(version: int, current: int, max_staleness: int | None) -> bool:
    """True when a rollout of ``version`` is more than ``max_staleness`` versions behind ``current``."""
    return max_staleness is not None and version < current - max_staleness


class RolloutGroup(list[Item]):
    """One task's rollouts, ``(row, result | RolloutFailureRecord)`` pairs ordered by rollout index.

    A plain list with the versions of its rollouts on top (each row carries ``_ng_policy_version``).
    """

    @property
    def task_index(self) -> int:
        """The group's task index (``_ng_task_index``)."""
        return int(self[0][0][keys.TASK_INDEX])

    @property
    def oldest_version(self) -> int:
        """The oldest policy version among the group's rollouts."""
        return min(version_of(item) for item in self)

    @property
    def newest_version(self) -> int:
        """The newest policy version among the group's rollouts."""
        return max(version_of(item) for item in self)

    @property
    def rewards(self) -> list[float | None]:
        """Each rollout's ``reward`` in order; None for a failure record or a result without a reward."""
        out: list[float | None] = []
        for _, outcome in self:
            reward = outcome.get(keys.REWARD) if isinstance(outcome, dict) else None
            out.append(
                float(reward) if isinstance(reward, int | float) and not isinstance(reward, bool) else None
            )
        return out

    @property
    def failures(self) -> list[RolloutFailureRecord]:
        """The failure records among the group's outcomes, in rollout order (empty when none failed)."""
        return [outcome for _, outcome in self if isinstance(outcome, RolloutFailureRecord)]

    def advantages(self, *, normalize: bool = False, eps: float = 1e-6) -> list[float | None]:
        """Group-relative advantages: each reward minus the mean reward of the group (GRPO's baseline).

        Rollouts without a reward (failure records, results without ``reward``) are left out of the mean
        and get None, so the caller sees which ones had no advantage. ``normalize=True`` also divides by
        the population standard deviation of those rewards plus ``eps``, as GRPO does. A group with no
        reward at all gives all None.
        """
        rewards = self.rewards
        known = [r for r in rewards if r is not None]
        if not known:
            return [None] * len(rewards)
        mean = sum(known) / len(known)
        scale = 1.0
        if normalize:
            scale = math.sqrt(sum((r - mean) ** 2 for r in known) / len(known)) + eps
        return [None if r is None else (r - mean) / scale for r in rewards]
