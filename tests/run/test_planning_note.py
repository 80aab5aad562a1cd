"""A large input file takes seconds to validate: with progress shown, a run says so on stderr before it
starts (before Ray starts, on Ray), instead of staying silent; small inputs and passed rows print nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gym_ray.config.run_config import RunConfig
from gym_ray.distributed.api import acollect
from gym_ray.errors import InputError
from gym_ray.run.collect import acollect_local
from gym_ray.run.preflight import PLANNING_NOTE_BYTES, planning_note
from gym_ray.servers import Deployment


def _big_file(tmp_path: Path) -> Path:
    """A 16 MiB input of NUL bytes (sparse: nothing is written), which is no JSON."""
    path = tmp_path / "big.jsonl"
    with path.open("wb") as out:
        out.truncate(PLANNING_NOTE_BYTES)
    return path


def test_the_note_names_the_size_and_the_file_of_a_large_input_only(tmp_path: Path) -> None:
    big = _big_file(tmp_path)
    small = tmp_path / "small.jsonl"
    small.write_text('{"x": 1}\n', encoding="utf-8")
    settings = RunConfig.from_dict({"input_jsonl_fpath": str(big)}).settings
    assert planning_note(settings, before_ray=True) == (
        f"gym-ray: reading and validating 16.0 MiB of input rows ({big}) before Ray starts"
    )
    assert planning_note(settings, before_ray=False) == (
        f"gym-ray: reading and validating 16.0 MiB of input rows ({big}) before the first rollout is sent"
    )
    for other in (small, tmp_path / "missing.jsonl"):
        settings = RunConfig.from_dict({"input_jsonl_fpath": str(other)}).settings
        assert planning_note(settings, before_ray=True) is None


@pytest.mark.parametrize("progress", [True, False])
async def test_a_local_run_says_it_validates_a_large_input_when_progress_is_shown(
    tmp_path: Path, deployment: Deployment, capsys: pytest.CaptureFixture[str], progress: bool
) -> None:
    big = _big_file(tmp_path)
    with pytest.raises(InputError, match="line 1"):
        await acollect_local(
            deployment.config, input_jsonl_fpath=str(big), output_dir=str(tmp_path / "run"), progress=progress
        )
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gym-ray: reading")]
    assert notes == ([planning_note(_settings(big), before_ray=False)] if progress else [])


async def test_a_ray_run_says_it_before_ray_starts(
    tmp_path: Path,
    deployment: Deployment,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_ray(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("Ray was started for an input that is no JSON")

    monkeypatch.setattr("gym_ray.distributed.api.ray_connection", no_ray)
    big = _big_file(tmp_path)
    with pytest.raises(InputError, match="line 1"):
        await acollect(
            deployment.config, input_jsonl_fpath=str(big), output_dir=str(tmp_path / "run"), progress=True
        )
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gym-ray: reading")]
    assert notes == [planning_note(_settings(big), before_ray=True)]


def _settings(path: Path) -> Any:
    return RunConfig.from_dict({"input_jsonl_fpath": str(path)}).settings
