"""Planning's second pass as one loop (:mod:`gym_ray.plan._proven_pass`) gives what the general chain of
generators gives: the same rows, numbered alike, the same shard files, the same errors."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from gym_ray.config.run_config import RunConfig
from gym_ray.errors import InputError
from gym_ray.plan import _parallel_pass, shards
from gym_ray.plan._compact_index import CompactIndex
from gym_ray.plan._proven_pass import proven_rows
from gym_ray.plan.first_pass import input_rows
from gym_ray.plan.load import Stopped
from gym_ray.plan.shards import iter_prepare_run
from gym_ray.record.manifest import ShardManifest
from gym_ray.servers import load_bundled_config


def _row(question: str, **extra: Any) -> dict[str, Any]:
    return {"responses_create_params": {"input": question}, "agent_ref": {"name": "arith_agent"}, **extra}


def _lines() -> list[str]:
    """Varied lines: unicode and escapes, repeated rows (one with other whitespace), rows with their own
    task or rollout index, an attempt index, nested values, a 19-digit integer (its block is not plain)."""
    rows = [
        _row('é ✓ "q" \\ 😀', meta={"b": 1, "a": [1.5, "é", None, True]}),
        _row("q1", _ng_task_index=7),
        _row("q2", _ng_rollout_index=5, extra="x"),
        _row('é ✓ "q" \\ 😀', meta={"b": 1, "a": [1.5, "é", None, True]}),
        _row("q3", _ng_attempt_index=2, n=-0.0, e=1e-7),
        _row("q4", big=1234567890123456789),
        _row("q1", _ng_task_index=7),
    ]
    lines = [json.dumps(r, ensure_ascii=False) for r in rows]
    lines[3] = lines[3].replace(",", " ,\t")  # other whitespace, same content
    return lines * 3


def _settings(tmp_path: Path, lines: list[str], *, bom: bool = False, **extra: Any) -> RunConfig:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "rows.jsonl"
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + ("\n".join(lines) + "\n").encode())
    return RunConfig.from_dict(
        {
            **load_bundled_config(),
            "input_jsonl_fpath": str(path),
            "output_dir": str(tmp_path / "run"),
            **extra,
        }
    )


def _both(run: RunConfig, stop: threading.Event | None = None) -> tuple[list[Any], list[Any]]:
    """The rows of the one loop and of the general pass, or the error each raised (type and message)."""

    def through(read: Any) -> Any:
        return read

    def collect(make: Any) -> list[Any]:
        try:
            return list(make())
        except (InputError, Stopped) as exc:
            return [type(exc).__name__, str(exc)]

    def loop() -> Any:
        rows = proven_rows(run.settings, run.topology, stop, through, CompactIndex())
        assert rows is not None
        return rows

    def general() -> Any:
        return input_rows(run.settings, run.topology, None, stop, proven_by=through)(CompactIndex())

    return collect(loop), collect(general)


@pytest.mark.parametrize("repeats", [1, 3])
@pytest.mark.parametrize("bom", [False, True])
def test_the_loop_yields_the_general_pass_s_rows(tmp_path: Path, repeats: int, bom: bool) -> None:
    fast, general = _both(_settings(tmp_path, _lines(), bom=bom, num_repeats=repeats))
    assert len(fast) == 21 * repeats
    assert fast == general
    assert [list(row) for row in fast] == [list(row) for row in general]  # same keys in the same order
    # the repeated row numbers into its first task; a row's own task index is kept
    assert fast[3 * repeats]["_ng_task_index"] == fast[0]["_ng_task_index"] == 0
    assert fast[repeats]["_ng_task_index"] == 7


def test_a_line_orjson_refuses_is_read_as_json_reads_it(tmp_path: Path) -> None:
    lines = [
        *_lines(),
        '{"responses_create_params": {"input": "n"}, "agent_ref": {"name": "arith_agent"}, "x": NaN}',
    ]
    fast, general = _both(_settings(tmp_path, lines, strict_json=False))
    assert fast == general
    assert str(fast[-1]["x"]) == "nan"


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{bad", "line 22: malformed JSON"),
        ("", "line 22: blank line"),
        ('["a list"]', "line 22: the row "),
    ],
)
def test_a_bad_line_raises_the_general_pass_s_error(tmp_path: Path, bad: str, message: str) -> None:
    fast, general = _both(_settings(tmp_path, [*_lines(), bad, *_lines()]))
    assert fast == general
    assert fast[0] == "InputError"
    assert message in fast[1]


def test_a_set_stop_stops_both_alike(tmp_path: Path) -> None:
    stop = threading.Event()
    stop.set()
    assert _both(_settings(tmp_path, _lines()), stop) == (["Stopped", "stopped"], ["Stopped", "stopped"])


def test_limit_or_a_knob_that_rewrites_rows_takes_the_general_pass(tmp_path: Path) -> None:
    for extra in ({"limit": 3}, {"num_repeats_add_seed": True}):
        run = _settings(tmp_path, _lines(), **extra)
        assert proven_rows(run.settings, run.topology, None, lambda read: read, CompactIndex()) is None


def _planned(run_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path in sorted(run_dir.iterdir()):
        if path.name.endswith(".manifest.json"):
            manifest = ShardManifest.model_validate_json(path.read_bytes())
            out[path.name] = manifest.model_dump(exclude={"created_at", "run_id"})
        elif path.name.endswith("_materialized_inputs.jsonl"):
            out[path.name] = path.read_bytes()
    return out


@pytest.mark.parametrize("processes", [None, 2])
def test_a_planned_folder_is_byte_identical_with_and_without_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, processes: int | None
) -> None:
    monkeypatch.setattr(_parallel_pass, "PROCESSES", processes)  # 2: the validation pass over 2 byte ranges
    lines = _lines() * 4
    used: list[bool] = []
    real = shards.proven_rows

    def spy(*args: Any) -> Any:
        rows = real(*args)
        used.append(rows is not None)
        return rows

    monkeypatch.setattr(shards, "proven_rows", spy)
    fast = _settings(tmp_path / "fast", lines, num_repeats=2, shard_size=5)
    assert sum(spec.num_rows for spec in iter_prepare_run(fast)) == 168
    assert used == [True]
    monkeypatch.setattr(shards, "proven_rows", lambda *args: None)
    general = _settings(tmp_path / "general", lines, num_repeats=2, shard_size=5)
    assert sum(spec.num_rows for spec in iter_prepare_run(general)) == 168
    planned = _planned(tmp_path / "fast" / "run")
    assert len(planned) == 2 * 28  # a task's 2 rollouts together, cut after 6 rows: 28 shards
    assert planned == _planned(tmp_path / "general" / "run")
