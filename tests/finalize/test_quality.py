"""finalize/quality.py: NeMo Gym 0.7's rollout-quality reports, byte for byte against 0.7's recorded ones."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gym_ray.finalize.quality import normalize_ignored_checks, write_quality_reports

_RECORDED = Path(__file__).parent / "nemo_gym_0_7_quality"


@pytest.mark.parametrize(
    ("ignored", "expected"),
    [
        pytest.param((), _RECORDED, id="every-check"),
        pytest.param(
            "agent_turn_hollow,record_unreadable, task_consistently_unhealthy",
            _RECORDED / "ignored",
            id="ignored",
        ),
    ],
)
def test_the_reports_are_0_7s_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ignored: str | tuple[str, ...], expected: Path
) -> None:
    shutil.copy(_RECORDED / "rollouts.jsonl", tmp_path / "rollouts.jsonl")
    monkeypatch.chdir(tmp_path)  # 0.7 ran on the relative path: unreadable lines name it
    reports = write_quality_reports(Path("rollouts.jsonl"), ignored_checks=normalize_ignored_checks(ignored))
    assert reports.summary_path == Path("quality_summary.json")
    for name in ("quality_summary.json", "rollout_verdicts.jsonl"):
        assert (tmp_path / name).read_bytes() == (expected / name).read_bytes(), name


def test_ignored_checks_are_read_as_0_7_reads_them() -> None:
    assert normalize_ignored_checks(None) == ()
    assert normalize_ignored_checks(" model_call_failed, ,model_call_failed,agent_turn_hollow") == (
        "model_call_failed",
        "agent_turn_hollow",
    )
    with pytest.raises(ValueError, match=r"^unknown rollout health check\(s\): nope; the checks are "):
        normalize_ignored_checks(["nope"])
