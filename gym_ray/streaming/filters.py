"""Group filters: which complete groups a stream delivers (DAPO-style dynamic sampling and the like).

A stream built with ``group_filter=f`` (or a list of filters) calls ``f(group)`` on every complete group
before it enters the buffer; ``f`` returns True to keep the group. A dropped group is never delivered nor
recorded, its place goes to the next prompt of the input (so a batch still fills up), and
``stats().filtered`` counts drops by reason: the name of the first filter that returned False.

:func:`drop_uniform_reward` is the built-in: a group whose rollouts all have the same reward has zero
advantage under group-relative baselines (GRPO, DAPO) and teaches nothing. :func:`drop_failed` drops a
group holding a failure record (its ``rewards`` entry is None), as NeMo RL and slime leave failed samples
out of a batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gym_ray.errors import UsageError
from gym_ray.streaming.groups import RolloutGroup

__all__ = ["GroupFilter", "drop_failed", "drop_uniform_reward", "filter_names", "filter_verdict"]

#: ``(group) -> bool``: True keeps the group.
GroupFilter = Callable[[RolloutGroup], bool]


def drop_uniform_reward(group: RolloutGroup) -> bool:
    """Keep a group unless every rollout has the same reward (a failure record counts as no reward).

    Returns:
        False (drop) when all rewards are equal, so a one-rollout group is always dropped; else True.
    """
    return len(set(group.rewards)) > 1


def drop_failed(group: RolloutGroup) -> bool:
    """Keep a group only when none of its rollouts is a failure record.

    Returns:
        False (drop) when any outcome is a :class:`~gym_ray.dispatch.outcomes.RolloutFailureRecord`.
    """
    return not group.failures


def filter_names(filters: Sequence[GroupFilter]) -> list[str]:
    """The reason each filter's drops are counted under: its ``__name__`` (else its ``repr``).

    Raises:
        UsageError: A filter is not callable, or two filters share a name.
    """
    names = []
    for f in filters:
        if not callable(f):
            raise UsageError(f"stream: group_filter {f!r} is not callable; pass a function (group) -> bool")
        names.append(str(getattr(f, "__name__", repr(f))))
    if len(set(names)) != len(names):
        raise UsageError(f"stream: group filters {names} share a name; give each filter its own name")
    return names


def filter_verdict(filters: Sequence[GroupFilter], names: Sequence[str], group: RolloutGroup) -> str | None:
    """None to keep ``group``, else the name of the first filter that drops it.

    Raises:
        UsageError: A filter returned something other than a bool.
    """
    for f, name in zip(filters, names, strict=True):
        verdict = f(group)
        if isinstance(verdict, bool) or type(verdict).__name__ == "bool_":  # numpy's bool too
            if not verdict:
                return name
            continue
        raise UsageError(
            f"group_filter {name} returned {verdict!r} for task {group.task_index}; "
            "return True to keep the group or False to drop it"
        )
    return None
