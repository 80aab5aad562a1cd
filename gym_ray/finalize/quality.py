"""NeMo Gym 0.7's post-run rollout-quality pass: ``quality_summary.json`` and ``rollout_verdicts.jsonl``.

0.7 runs it after aggregation unless ``disable_health_check`` (or ``disable_aggregation``) is set: it reads
the written rollouts file again and writes both reports into that file's folder. :func:`write_quality_reports`
writes the same two files, byte for byte, for rollouts that carry no trajectory evidence (no
``ng_trajectory``, ``ng_model_call_capture`` or ``ng_agent_observations``), which is what gym_ray's runs
write: 0.7's twelve rollout checks then split into the three that read the record alone (evaluated: an
unreadable line, a rollout written twice, the check-error slot) and the nine that read the trajectory
(unobserved), and its two task checks see no observed model calls. Rollouts that do carry such evidence
need 0.7's trajectory checks (its canonical ``TrajectoryRecord`` and model-call bindings), which gym_ray
does not have: :func:`write_quality_reports` then writes neither file (and removes earlier ones, which would
describe another run) and says why.

Memory: one small record per rollout (its identity, verdict and token counts) until the reports are
written, as in 0.7; the verdicts are sorted by ``(task, rollout, stage)`` before writing.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from gym_ray import keys
from gym_ray.record.atomic import atomic_write_bytes

__all__ = [
    "HEALTH_CHECK_IDS",
    "QUALITY_SUMMARY_FILE",
    "ROLLOUT_VERDICTS_FILE",
    "TRAJECTORY_EVIDENCE_KEYS",
    "QualityReports",
    "normalize_ignored_checks",
    "write_quality_reports",
]

logger = logging.getLogger(__name__)

QUALITY_SUMMARY_FILE = "quality_summary.json"
ROLLOUT_VERDICTS_FILE = "rollout_verdicts.jsonl"

#: 0.7's rollout checks that read only the parsed record (evaluated for every readable line).
_RECORD_CHECKS = ("check_execution_error", "record_unreadable", "rollout_duplicate_identity")
#: 0.7's rollout checks that read the rollout's trajectory (unobserved without one).
_TRAJECTORY_CHECKS = (
    "rollout_missing_agent_turns",
    "rollout_ended_on_failed_model_call",
    "agent_turn_hollow",
    "model_call_zero_completion_tokens",
    "model_call_missing_token_counts",
    "trajectory_capture_mismatch",
    "model_call_failed",
    "rollout_token_count_mismatch",
    "model_call_runaway_generation",
)
_ROLLOUT_CHECKS = _RECORD_CHECKS + _TRAJECTORY_CHECKS
_TASK_CHECKS = ("task_consistently_unhealthy", "task_no_successful_model_calls")
#: Every check id of 0.7's registry (``nemo_gym.health.checks.CHECK_REGISTRY``), in its order.
HEALTH_CHECK_IDS = _ROLLOUT_CHECKS + _TASK_CHECKS
#: Result keys 0.7 turns into trajectory evidence; rollouts with any of them are outside this pass.
TRAJECTORY_EVIDENCE_KEYS = ("ng_trajectory", "ng_model_call_capture", "ng_agent_observations")


def normalize_ignored_checks(value: Any) -> tuple[str, ...]:
    """``health_check_ignored_checks`` as 0.7 reads it: a list, or one comma-separated string; blanks
    dropped, first occurrence kept.

    Raises:
        ValueError: An id that is not one of 0.7's checks (all of them are named).
    """
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    if not all(isinstance(item, str) for item in items):
        raise ValueError(f"health_check_ignored_checks must be check ids (strings), got {value!r}")
    checks = tuple(dict.fromkeys(item.strip() for item in items if item.strip()))
    unknown = sorted(set(checks) - set(HEALTH_CHECK_IDS))
    if unknown:
        raise ValueError(
            f"unknown rollout health check(s): {', '.join(unknown)}; "
            f"the checks are {', '.join(HEALTH_CHECK_IDS)}"
        )
    return checks


@dataclass
class _Digest:
    """One written rollout line, as the reports need it."""

    task: Any
    rollout: Any
    stage: Any
    rollout_id: str
    verdict: str
    findings: list[dict[str, Any]]
    unobserved: list[str]
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class QualityReports:
    """What :func:`write_quality_reports` did.

    Attributes:
        summary_path / verdicts_path: The files written, or None when none was (``skipped_because`` says why).
        verdicts: ``{"healthy": n, "unhealthy": n, "unobserved": n}`` over the rollout lines.
        skipped_because: Why no report was written, or None.
    """

    summary_path: Path | None
    verdicts_path: Path | None
    verdicts: dict[str, int] = field(default_factory=dict)
    skipped_because: str | None = None


def _usage_tokens(record: dict[str, Any]) -> tuple[int, int]:
    # The response's usage, Responses API names first; only non-negative ints count (0.7's rule).
    response = record.get("response")
    usage = response.get("usage") if isinstance(response, dict) else None
    if not isinstance(usage, dict):
        return 0, 0
    prompt = usage.get("input_tokens", usage.get("prompt_tokens"))
    completion = usage.get("output_tokens", usage.get("completion_tokens"))
    return (
        prompt if type(prompt) is int and prompt >= 0 else 0,
        completion if type(completion) is int and completion >= 0 else 0,
    )


def _digest(raw: bytes, path: Path, line_number: int, ordinal: int, ignored: frozenset[str]) -> _Digest:
    try:
        record = orjson.loads(raw)
        if not isinstance(record, dict):
            raise ValueError("rollout line is not an object")
    except Exception as exc:  # an unreadable line is a finding, not an error of the pass
        task = f"__unreadable_record__:input-0:line-{line_number}"
        findings: list[dict[str, Any]] = []
        if "record_unreadable" not in ignored:
            findings.append(
                {
                    "check": "record_unreadable",
                    "locator": {"source_file": str(path), "line": line_number},
                    "detail": {"reason": "rollout record is unreadable", "error": type(exc).__name__},
                }
            )
        unobserved = [c for c in _ROLLOUT_CHECKS if c not in ignored and c != "record_unreadable"]
        verdict = "unhealthy" if findings else "unobserved" if unobserved else "healthy"
        return _Digest(task, 0, None, f"{task}-0", verdict, findings, unobserved)
    task = record.get(keys.TASK_INDEX, ordinal)
    rollout = record.get(keys.ROLLOUT_INDEX, 0)
    rollout_id = str(record.get(keys.ROLLOUT_ID) or f"{task}-{rollout}")
    unobserved = [c for c in _TRAJECTORY_CHECKS if c not in ignored]
    prompt, completion = _usage_tokens(record)
    verdict = "unobserved" if unobserved else "healthy"
    return _Digest(
        task, rollout, record.get("stage_index"), rollout_id, verdict, [], unobserved, prompt, completion
    )


def _has_trajectory_evidence(raw: bytes) -> bool:
    if not any(key.encode() in raw for key in TRAJECTORY_EVIDENCE_KEYS):
        return False  # the common case, decided without parsing
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    return isinstance(record, dict) and any(record.get(key) is not None for key in TRAJECTORY_EVIDENCE_KEYS)


def _read_digests(path: Path, ignored: frozenset[str]) -> list[_Digest] | None:
    """Every non-blank line's digest (line numbers count blank lines too); None at trajectory evidence."""
    digests: list[_Digest] = []
    with open(path, "rb") as handle:
        for line_number, line in enumerate(handle, start=1):
            raw = line.strip()
            if not raw:
                continue
            if _has_trajectory_evidence(raw):
                return None
            digests.append(_digest(raw, path, line_number, len(digests), ignored))
    return digests


def _mark_duplicates(digests: list[_Digest], ignored: frozenset[str]) -> None:
    if "rollout_duplicate_identity" in ignored:
        return
    copies: dict[Any, list[_Digest]] = {}
    for digest in digests:
        copies.setdefault((digest.stage, digest.task, digest.rollout), []).append(digest)
    for group in copies.values():
        if len(group) > 1:
            for digest in group:
                digest.findings.append(
                    {"check": "rollout_duplicate_identity", "detail": {"duplicate_count": len(group)}}
                )
                digest.verdict = "unhealthy"


def _summary(digests: list[_Digest], ignored: frozenset[str]) -> dict[str, Any]:
    # Per task, one verdict per rollout index (copies that disagree count as unobserved).
    repeats: dict[Any, dict[Any, str]] = {}
    for digest in digests:
        verdicts = repeats.setdefault(digest.task, {})
        seen = verdicts.get(digest.rollout)
        verdicts[digest.rollout] = digest.verdict if seen in (None, digest.verdict) else "unobserved"
    coverage = {check: {"evaluated": 0, "unobserved": 0, "ignored": 0} for check in HEALTH_CHECK_IDS}
    for digest in digests:
        missing = set(digest.unobserved)
        for check in _ROLLOUT_CHECKS:
            slot = "ignored" if check in ignored else "unobserved" if check in missing else "evaluated"
            coverage[check][slot] += 1
    issues: Counter[str] = Counter(f["check"] for d in digests for f in d.findings)
    flags: dict[Any, list[str]] = {task: [] for task in repeats}
    for task, by_rollout in repeats.items():
        if "task_consistently_unhealthy" in ignored:
            coverage["task_consistently_unhealthy"]["ignored"] += 1
        else:
            computable = [v for v in by_rollout.values() if v != "unobserved"]
            if len(computable) >= 2:
                coverage["task_consistently_unhealthy"]["evaluated"] += 1
                if all(v == "unhealthy" for v in computable):
                    flags[task].append("task_consistently_unhealthy")
                    issues["task_consistently_unhealthy"] += 1
            else:
                coverage["task_consistently_unhealthy"]["unobserved"] += 1
        # Needs every repeat's policy model calls observed, which takes a trajectory: never here.
        slot = "ignored" if "task_no_successful_model_calls" in ignored else "unobserved"
        coverage["task_no_successful_model_calls"][slot] += 1
    counted = Counter(d.verdict for d in digests)
    tasks = {}
    for task in sorted(repeats, key=lambda t: (isinstance(t, str), str(t))):
        counts = Counter(repeats[task].values())
        tasks[str(task)] = {
            "repeats": len(repeats[task]),
            "healthy": counts["healthy"],
            "unhealthy": counts["unhealthy"],
            "unobserved": counts["unobserved"],
            "flags": flags[task],
        }
    return {
        "run": {
            "ignored_checks": sorted(ignored),
            "artifacts": {"records": len(digests), "captures": 0, "coverage": coverage},
            "verdicts": {k: counted[k] for k in ("healthy", "unhealthy", "unobserved")},
            "issues": {check: issues[check] for check in HEALTH_CHECK_IDS},
            "stats": {
                "model_call_errors": {
                    "total": 0,
                    "by_status": {},
                    "rollouts_affected": 0,
                    "ended_on_error": 0,
                },
                "duplicated_calls": {"replayed": 0, "rollouts": 0},
                "tokens": {
                    "prompt": sum(d.prompt_tokens for d in digests),
                    "completion": sum(d.completion_tokens for d in digests),
                    "capture_prompt": 0,
                    "capture_completion": 0,
                },
            },
        },
        "tasks": tasks,
    }


def _order(value: Any) -> tuple[int, Any]:
    return (0, value) if isinstance(value, int) else (1, str(value))


def _verdict_lines(digests: Iterable[_Digest]) -> Iterable[bytes]:
    for d in sorted(digests, key=lambda d: (_order(d.task), _order(d.rollout), _order(d.stage))):
        row: dict[str, Any] = {
            keys.TASK_INDEX: d.task,
            keys.ROLLOUT_INDEX: d.rollout,
            "rollout_id": d.rollout_id,
            "verdict": d.verdict,
            "findings": d.findings,
            "unobserved": d.unobserved,
        }
        if d.stage is not None:
            row["stage_index"] = d.stage
        yield orjson.dumps(row) + b"\n"


def write_quality_reports(rollouts_path: str | Path, *, ignored_checks: Sequence[str] = ()) -> QualityReports:
    """Write 0.7's two quality reports for a rollouts file, into its folder.

    Args:
        rollouts_path: The written rollouts (``output_jsonl_fpath``).
        ignored_checks: Check ids left out (``health_check_ignored_checks``), already normalized.

    Returns:
        The paths written and the verdict counts; or, when a rollout carries trajectory evidence, no paths,
        the reason, and the folder's earlier reports removed.

    Raises:
        OSError: The rollouts file could not be read or a report written.
    """
    path = Path(rollouts_path)
    ignored = frozenset(ignored_checks)
    summary_path, verdicts_path = path.parent / QUALITY_SUMMARY_FILE, path.parent / ROLLOUT_VERDICTS_FILE
    digests = _read_digests(path, ignored)
    if digests is None:
        for stale in (summary_path, verdicts_path):
            stale.unlink(missing_ok=True)
        return QualityReports(
            None,
            None,
            skipped_because=(
                f"{path} has rollouts with trajectory evidence "
                f"({', '.join(TRAJECTORY_EVIDENCE_KEYS)}); NeMo Gym "
                "0.7's trajectory checks are not in gym_ray: run `gym eval health-check` on the output"
            ),
        )
    _mark_duplicates(digests, ignored)
    summary = _summary(digests, ignored)
    atomic_write_bytes(summary_path, orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    atomic_write_bytes(verdicts_path, b"".join(_verdict_lines(digests)))
    return QualityReports(summary_path, verdicts_path, verdicts=dict(summary["run"]["verdicts"]))
