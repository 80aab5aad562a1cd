"""Planning's validation pass over an input file, without building the rows of common input rows.

:func:`gym_ray.plan.shards.iter_prepare_run` reads its input twice: this pass validates every row, counts
the rows the run will have and records each task-numbering lookup (:mod:`gym_ray.plan._spill_dedupe`);
the second pass cuts shards. For a common row (:mod:`gym_ray.plan._common_rows`) the general pass builds
``num_repeats`` stamped copies only to check them, and every copy is checked alike: here the row's task is
numbered (the same lookups, in the same order, as the second pass makes), its copies are counted, and its
``(agent, task_source)`` is checked once per distinct pair. Every other row goes through the general
expansion and check, in order.

The pass only decides *whether* the input is valid: at the first row with a problem it raises
:class:`RowsInvalid` and the caller runs the general pass (exact task numbers in the messages), which
raises the error a user sees.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from gym_ray import keys
from gym_ray.config.topology import Topology
from gym_ray.plan.preprocess import TaskNumbering, _Preprocessor
from gym_ray.plan.validation import _Validator

if TYPE_CHECKING:  # the range process imports this module without pydantic (its settings are plain data)
    from gym_ray.config.settings import RunSettings

__all__ = ["RowsInvalid", "count_valid_rows"]


class RowsInvalid(Exception):
    """Some input row does not validate; the general validation pass says which and why."""


def preprocess_knobs(settings: RunSettings) -> dict[str, Any]:
    """The run settings that preprocessing takes, as keyword arguments (one list for every pass)."""
    return {
        "agent_map": settings.agent_map,
        "fan_out": settings.fan_out,
        "num_repeats": settings.num_repeats,
        "num_repeats_add_seed": settings.num_repeats_add_seed,
        "task_ids": settings.task_ids,
        "responses_create_params": settings.responses_create_params,
    }


def count_valid_rows(
    rows: Iterable[Mapping[str, Any]], settings: RunSettings, topology: Topology, numbering: TaskNumbering
) -> int | None:
    """The number of rows the run plans from ``rows``, or None when some row has a problem.

    Args:
        rows: The input rows, just parsed from the input file (``load_jsonl``; nobody else sees them).
        settings: The run's settings (``agent_map``, ``num_repeats``, ...; not ``interleave_repeats``).
        topology: The running config.
        numbering: Receives every task-numbering lookup, as the general preprocessing pass would make it.

    Returns:
        The count of preprocessed rows, or None when ``settings`` rewrite rows (nothing was read: the
        caller runs the general pass).

    Raises:
        RowsInvalid: A row does not validate (lookups up to it were made).
        GymRayError: What reading or preprocessing the rows raises (the general pass raises it too).
    """
    state = _Preprocessor(
        **preprocess_knobs(settings), topology=topology, task_numbering=numbering, from_json=True
    )
    common = state.common
    if common is None:
        return None
    validator = _Validator(topology)
    number, clean, check = common.number, validator.flat_row_clean, validator.check
    repeats = common.num_repeats
    source_key = keys.TASK_SOURCE
    count = 0
    for pos, row in enumerate(rows):
        agent = number(row)
        if agent is not None:
            if clean(agent, row.get(source_key)):
                count += repeats
                continue
            raise RowsInvalid(f"row {pos}")  # the general pass names it
        for item in state.expand(pos, row):
            check(count, item)
            count += 1
    state.finish()
    if validator.found():
        raise RowsInvalid("rows expanded by the general path")
    return count
