"""The ``/aggregate_metrics`` computation of the reference servers (NeMo Gym's default, without pandas).

``compute_aggregate_metrics(verify_responses)`` reproduces NeMo Gym 0.7's ``RewardProfiler`` output
(see ``reference/wire/collector_to_envserver_aggregate_metrics.json``) and adds the pass@k family a
benchmark's ``compute_metrics`` hook usually adds (``compute_pass_majority_metrics``):

* per numeric field: ``mean/<f>``, ``max/<f>``, ``min/<f>``, ``median/<f>``, ``std/<f>`` (sample std,
  ddof=1). When every std is undefined (one sample per column), std is reported as 0 for the columns
  without gaps; otherwise an undefined statistic is omitted (pandas NaN filtering).
* numeric fields are the result's top-level ints and floats plus ``response.usage``'s top-level ints and
  floats. Booleans, strings, ``None``, nested objects and the ``_ng_*`` identity keys are not fields (this
  matches the 0.7 capture, where ``mask_sample: false`` yields no metric).
* ``group_level_metrics``: one dict per task index (ascending) with the stats, ``sample``,
  ``num_rollouts``, ``expected_num_rollouts``, ``missing_num_rollouts``,
  ``reward_profile_completion_pct`` and ``rollout_infos``.
* ``agent_metrics``: the stats over all rollouts, ``num_repeats`` (the most rollouts any task has), then
  ``pass@k/accuracy``, ``pass@1[avg-of-k]/accuracy``, ``majority@k/accuracy`` (when the answer key is
  present), their ``no_answer`` twins, ``per_sample_aggregate`` and the across-run spread. Percentages
  are 0-100; pass@k for binary scores is the unbiased ``1 - C(n_incorrect, k) / C(n, k)``.
* ``key_metrics``: every ``mean/*`` entry of ``agent_metrics``.

Pure functions: no I/O, no shared state; safe from any thread.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from gym_ray import keys
from gym_ray.errors import InputError

#: The stats reported per numeric field, in NeMo Gym's order.
STAT_NAMES: tuple[str, ...] = ("mean", "max", "min", "median", "std")

#: Default field holding a rollout's extracted answer (enables ``majority@k`` and ``no_answer``).
DEFAULT_ANSWER_KEY = "extracted_answer"

ScoreFn = Callable[[Mapping[str, Any]], Mapping[str, float | int | bool]]


def empty_aggregate_metrics() -> dict[str, Any]:
    """The reply for an empty ``verify_responses`` list (every collection empty)."""
    return {
        "group_level_metrics": [],
        "agent_metrics": {},
        "key_metrics": {},
        "perf_summary": None,
        "repeat_level_metrics": [],
    }


def compute_aggregate_metrics(
    verify_responses: Sequence[Mapping[str, Any]],
    *,
    answer_key: str | None = DEFAULT_ANSWER_KEY,
    score_fn: ScoreFn | None = None,
) -> dict[str, Any]:
    """Compute the ``/aggregate_metrics`` reply for a list of (stripped) verify responses.

    Args:
        verify_responses: one dict per rollout with at least ``reward``; ``_ng_task_index`` and
            ``_ng_rollout_index`` default to 0.
        answer_key: field with the extracted answer; ``majority@k`` and ``no_answer`` are computed only
            when at least one response carries it. ``None`` disables them.
        score_fn: ``result -> {score name: value}``; default ``{"accuracy": reward}``.

    Returns:
        ``{"group_level_metrics", "agent_metrics", "key_metrics", "perf_summary": None,
        "repeat_level_metrics": []}`` in the shape of the NeMo Gym 0.7 capture.

    Raises:
        InputError: a response is not an object, has a non-integer index, or two responses share a
            ``(_ng_task_index, _ng_rollout_index)`` key.

    Example:
        >>> m = compute_aggregate_metrics([{"reward": 1.0}])
        >>> m["key_metrics"]
        {'mean/reward': 1.0}
    """
    if not verify_responses:
        return empty_aggregate_metrics()
    identities = [_identity(i, vr) for i, vr in enumerate(verify_responses)]
    seen: dict[tuple[int, int], int] = {}
    for i, ident in enumerate(identities):
        if ident in seen:
            raise InputError(
                f"verify_responses[{i}] repeats (_ng_task_index, _ng_rollout_index) = {ident} of "
                f"verify_responses[{seen[ident]}]; send each rollout once",
                row=i,
            )
        seen[ident] = i

    numeric = [_numeric_fields(vr) for vr in verify_responses]
    columns = _column_order(numeric)

    by_task: dict[int, list[int]] = defaultdict(list)
    for i, (task, _) in enumerate(identities):
        by_task[task].append(i)
    num_repeats = max(len(members) for members in by_task.values())

    groups: list[dict[str, Any]] = []
    for task in sorted(by_task):
        members = sorted(by_task[task], key=lambda i: identities[i][1])
        group: dict[str, Any] = {keys.TASK_INDEX: task}
        group.update(describe([numeric[i] for i in members], columns))
        group["sample"] = {keys.AGENT_REF: {"name": "agent"}}
        group["num_rollouts"] = len(members)
        group["expected_num_rollouts"] = num_repeats
        group["missing_num_rollouts"] = num_repeats - len(members)
        group["reward_profile_completion_pct"] = 100.0 * len(members) / num_repeats
        group["rollout_infos"] = [_rollout_info(identities[i], numeric[i], columns) for i in members]
        groups.append(group)

    agent_metrics: dict[str, Any] = describe(numeric, columns)
    agent_metrics["num_repeats"] = num_repeats
    tasks = [
        [verify_responses[i] for i in sorted(by_task[t], key=lambda i: identities[i][1])]
        for t in sorted(by_task)
    ]
    use_answer_key = answer_key if answer_key and any(answer_key in vr for vr in verify_responses) else None
    agent_metrics.update(compute_pass_majority_metrics(tasks, score_fn=score_fn, answer_key=use_answer_key))
    key_metrics = {k: v for k, v in agent_metrics.items() if k.startswith("mean/")}
    return {
        "group_level_metrics": groups,
        "agent_metrics": agent_metrics,
        "key_metrics": key_metrics,
        "perf_summary": None,
        "repeat_level_metrics": [],
    }


def describe(rows: Sequence[Mapping[str, float | int]], columns: Sequence[str]) -> dict[str, float]:
    """Per-column ``mean/max/min/median/std`` over ``rows`` (missing values skipped), as floats.

    Keys are ordered stat-major (every ``mean/*`` first), like pandas' stacked describe. A column with no
    value yields nothing. ``std`` needs two values; when no column has two, std is 0 for the columns that
    have a value in every row.
    """
    values = {c: [float(r[c]) for r in rows if c in r] for c in columns}
    present = [c for c in columns if values[c]]
    stds = {c: statistics.stdev(values[c]) if len(values[c]) >= 2 else math.nan for c in present}
    if stds and all(math.isnan(s) for s in stds.values()):
        stds = {c: 0.0 if len(values[c]) == len(rows) else math.nan for c in present}
    out: dict[str, float] = {}
    for stat in STAT_NAMES:
        for c in present:
            v = values[c]
            if stat == "mean":
                out[f"mean/{c}"] = math.fsum(v) / len(v)
            elif stat == "max":
                out[f"max/{c}"] = max(v)
            elif stat == "min":
                out[f"min/{c}"] = min(v)
            elif stat == "median":
                out[f"median/{c}"] = float(statistics.median(v))
            elif not math.isnan(stds[c]):
                out[f"std/{c}"] = stds[c]
    return out


def pass_at_k(n: int, n_correct: int, k: int) -> float:
    """Unbiased pass@k for one task as a fraction: ``1 - C(n - c, k) / C(n, k)`` (1.0 if n - c < k)."""
    n_incorrect = n - n_correct
    if n_incorrect < k:
        return 1.0
    return 1.0 - math.comb(n_incorrect, k) / math.comb(n, k)


def compute_pass_majority_metrics(
    tasks: Sequence[Sequence[Mapping[str, Any]]],
    *,
    score_fn: ScoreFn | None = None,
    answer_key: str | None = None,
) -> dict[str, Any]:
    """pass@k, pass@1[avg-of-k], majority@k and across-run spread, NeMo Gym's way (percent 0-100).

    Args:
        tasks: ``tasks[i]`` = the rollouts of task i, in rollout order.
        score_fn: ``result -> {score name: value}``; default ``{"accuracy": reward}``. Binary scores
            (every value 0/1) use the unbiased estimator; continuous ones the max of the first k.
        answer_key: field with the extracted answer; enables ``majority@k`` (ties averaged, tasks with
            no answer count 0) and a ``no_answer`` binary score.

    Returns:
        ``{"pass@{k}/{score}", "pass@1[avg-of-{k}]/{score}", "majority@{k}/{score}"?,
        "per_sample_aggregate": {score: [per-rollout-index pass@1]},
        "pass@1[avg-of-{k}]/{score}/std_dev_across_runs" and "/std_err_across_runs" for k >= 2}``;
        ``{}`` when ``tasks`` is empty.
    """
    if not tasks:
        return {}
    fn: ScoreFn = score_fn or _default_score
    max_k = max(len(rollouts) for rollouts in tasks)
    scores: list[list[dict[str, float]]] = []
    answers: list[list[Any]] = []
    for rollouts in tasks:
        task_scores: list[dict[str, float]] = []
        task_answers: list[Any] = []
        for r in rollouts:
            s = {name: float(v) for name, v in fn(r).items()}
            if answer_key is not None:
                answer = r.get(answer_key)
                task_answers.append(answer)
                s["no_answer"] = 1.0 if answer is None else 0.0
            task_scores.append(s)
        scores.append(task_scores)
        answers.append(task_answers)
    names = sorted({name for task_scores in scores for s in task_scores for name in s})

    metrics: dict[str, Any] = {}
    for k in range(1, max_k + 1):
        for name in names:
            passes = [_task_pass(vals, k) for vals in _task_values(scores, name) if len(vals) >= k]
            if passes:
                metrics[f"pass@{k}/{name}"] = 100.0 * math.fsum(passes) / len(passes)
            avgs = [math.fsum(v) / len(v) for v in (_values(ts[:k], name) for ts in scores) if v]
            if avgs:
                metrics[f"pass@1[avg-of-{k}]/{name}"] = 100.0 * math.fsum(avgs) / len(avgs)
            if answer_key is not None:
                votes = [_majority(ts[:k], ans[:k], name) for ts, ans in zip(scores, answers, strict=True)]
                metrics[f"majority@{k}/{name}"] = 100.0 * math.fsum(votes) / len(votes)

    per_sample: dict[str, list[float]] = {}
    for name in names:
        runs: list[float] = []
        for run in range(max_k):
            vals = [ts[run][name] for ts in scores if run < len(ts) and name in ts[run]]
            if vals:
                runs.append(100.0 * math.fsum(vals) / len(vals))
        if runs:
            per_sample[name] = runs
    metrics["per_sample_aggregate"] = per_sample
    for k in range(2, max_k + 1):
        for name in names:
            runs = per_sample.get(name, [])[:k]
            if len(runs) >= 2:
                std_dev = statistics.stdev(runs)
                metrics[f"pass@1[avg-of-{k}]/{name}/std_dev_across_runs"] = std_dev
                metrics[f"pass@1[avg-of-{k}]/{name}/std_err_across_runs"] = std_dev / math.sqrt(len(runs))
    return metrics


def _default_score(result: Mapping[str, Any]) -> Mapping[str, float]:
    reward = result.get(keys.REWARD, 0.0)
    return {"accuracy": float(reward) if isinstance(reward, int | float) else 0.0}


def _values(task_scores: Iterable[Mapping[str, float]], name: str) -> list[float]:
    return [s[name] for s in task_scores if name in s]


def _task_values(scores: Sequence[Sequence[Mapping[str, float]]], name: str) -> Iterable[list[float]]:
    for task_scores in scores:
        vals = _values(task_scores, name)
        if vals:
            yield vals


def _task_pass(vals: Sequence[float], k: int) -> float:
    if all(v in (0.0, 1.0) for v in vals):
        return pass_at_k(len(vals), sum(1 for v in vals if v), k)
    return max(vals[:k])


def _majority(task_scores: Sequence[Mapping[str, float]], task_answers: Sequence[Any], name: str) -> float:
    valid = [
        (_hashable(a), s[name])
        for a, s in zip(task_answers, task_scores, strict=True)
        if a is not None and name in s
    ]
    if not valid:
        return 0.0
    counts = Counter(valid)
    top = max(counts.values())
    tied = [score for (_, score), c in counts.items() if c == top]
    return math.fsum(tied) / len(tied)


def _hashable(value: Any) -> Any:
    return value if isinstance(value, str | int | float | bool) else repr(value)


def _identity(i: int, vr: Mapping[str, Any]) -> tuple[int, int]:
    if not isinstance(vr, Mapping):
        raise InputError(
            f"verify_responses[{i}] is a {type(vr).__name__}, not a JSON object; send one object per rollout",
            row=i,
        )
    out: list[int] = []
    for key in (keys.TASK_INDEX, keys.ROLLOUT_INDEX):
        value = vr.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputError(
                f"verify_responses[{i}].{key} = {value!r} is not an integer; send the collector's indices",
                row=i,
            )
        out.append(value)
    return out[0], out[1]


def _numeric_fields(vr: Mapping[str, Any]) -> dict[str, float | int]:
    merged: dict[str, Any] = dict(vr)
    response = vr.get(keys.RESPONSE)
    usage = response.get(keys.USAGE) if isinstance(response, Mapping) else None
    if isinstance(usage, Mapping):
        merged.update(usage)
    return {
        k: v
        for k, v in merged.items()
        if isinstance(v, int | float)
        and not isinstance(v, bool)
        and not k.startswith(keys.PRIVATE_PREFIX)
        and not (isinstance(v, float) and math.isnan(v))
    }


def _column_order(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    columns: dict[str, None] = {}
    for row in rows:
        for k in row:
            columns.setdefault(k, None)
    return list(columns)


def _rollout_info(
    ident: tuple[int, int], fields: Mapping[str, float | int], columns: Sequence[str]
) -> dict[str, Any]:
    info: dict[str, Any] = {
        "rollout_id": f"{ident[0]}:{ident[1]}",
        keys.TASK_INDEX: ident[0],
        keys.ROLLOUT_INDEX: ident[1],
    }
    info.update({c: fields[c] for c in columns if c in fields})
    return info
