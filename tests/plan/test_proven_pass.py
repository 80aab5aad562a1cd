"""Planning's second pass as one loop (:mod:`gym_ray.plan._proven_pass`) gives what the general chain of
generators gives: the same rows, numbered alike, the same shard files, the same errors."""

from __future__ import annotations

import json
import random
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from gym_ray._json import dumps_compact_lines
from gym_ray.config.run_config import RunConfig
from gym_ray.errors import InputError
from gym_ray.plan import _parallel_pass, shards
from gym_ray.plan._compact_index import CompactIndex
from gym_ray.plan._proven_pass import proven_rows
from gym_ray.plan.first_pass import input_rows
from gym_ray.plan.load import NON_FINITE_HINT, Stopped, non_finite_problem
from gym_ray.plan.shards import iter_prepare_run
from gym_ray.record.manifest import ShardManifest
from gym_ray.servers import load_bundled_config
from tests.test_json_equivalence import _random_value


def _row(question: str, **extra: Any) -> dict[str, Any]:
    return {"responses_create_params": {"input": question}, "agent_ref": {"name": "arith_agent"}, **extra}


def _lines(*, marked: bool = False) -> list[str]:
    """Varied lines: unicode and escapes, repeated rows (one with other whitespace), rows with their own
    task or rollout index, an attempt index, nested values.
    Most lines are json's compact text (stamped as read), some are not (one with spaces, one with its
    non-ASCII escaped); ``marked``: values for which json and orjson may write other text (``null``, an
    exponent, a 19-digit integer: the block is not plain either), so no line of the block is stamped as
    read."""
    rows = [
        _row('é ✓ "q" \\ 😀 \n\t', meta={"b": 1, "a": [1.5, "é", True, -0.0, 0.1]}),
        _row("q1", _ng_task_index=7),
        _row("q2", _ng_rollout_index=5, extra="x"),
        _row('é ✓ "q" \\ 😀 \n\t', meta={"b": 1, "a": [1.5, "é", True, -0.0, 0.1]}),
        _row("q3", _ng_attempt_index=2, n=-12, f=2.25),
        _row("q4", nested={"deep": [[{"x": "y"}]]}),
        _row("q1", _ng_task_index=7),
        _row("q5", _ng_attempt_index="x", ascii="ü"),
    ]
    if marked:
        rows += [_row("q6", none=None, tiny=1e-7), _row("q7", big=1234567890123456789)]
    lines = [json.dumps(r, ensure_ascii=False, separators=(",", ":")) for r in rows]
    lines[3] = lines[3].replace(",", " ,\t")  # other whitespace, same content
    lines[7] = json.dumps(rows[7], separators=(",", ":"))  # "\u00fc": not orjson's text
    return lines * 3


def _normal(items: list[Any]) -> list[Any]:
    """Rows as ``(task, rollout, attempt, line)``, each line json's compact text of the row (what a shard
    file holds); a stamped line as it is; an error as it is."""
    out: list[Any] = []
    for item in items:
        if isinstance(item, dict):
            attempt = item.get("_ng_attempt_index")
            attempt = attempt if type(attempt) is int else 0
            out.append(
                (item["_ng_task_index"], item["_ng_rollout_index"], attempt, dumps_compact_lines([item]))
            )
        else:
            out.append(item)
    return out


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

    return _normal(collect(loop)), _normal(collect(general))


@pytest.mark.parametrize("marked", [False, True])
@pytest.mark.parametrize("repeats", [1, 3])
@pytest.mark.parametrize("bom", [False, True])
def test_the_loop_yields_the_general_pass_s_rows(
    tmp_path: Path, repeats: int, bom: bool, marked: bool
) -> None:
    run = _settings(tmp_path, _lines(marked=marked), bom=bom, num_repeats=repeats)
    fast, general = _both(run)
    assert len(fast) == (30 if marked else 24) * repeats
    assert fast == general
    # the repeated row numbers into its first task; a row's own task index is kept
    assert fast[3 * repeats][0] == fast[0][0] == 0
    assert fast[repeats][0] == 7
    # stamped as read: the compact lines without an own task / rollout index, not the spaced or escaped
    # ones; none when the block is marked
    rows = proven_rows(run.settings, run.topology, None, lambda read: read, CompactIndex())
    assert rows is not None
    stamped = [type(item) is tuple for item in rows]
    if marked:
        assert not any(stamped)
    else:
        assert stamped[: 8 * repeats] == [x for x in (1, 0, 0, 0, 1, 1, 0, 0) for _ in range(repeats)]


@pytest.mark.parametrize("strict_json", [True, False])
def test_a_line_orjson_cannot_vouch_for_is_read_as_json_reads_it(tmp_path: Path, strict_json: bool) -> None:
    # past 64 bits: orjson refuses the integer or reads a float, depending on its version
    lines = [
        *_lines(),
        '{"responses_create_params": {"input": "n"}, "agent_ref": {"name": "arith_agent"}, '
        '"x": 123456789012345678901234567890}',
    ]
    fast, general = _both(_settings(tmp_path, lines, strict_json=strict_json))
    assert fast == general
    assert fast[-1][3].endswith(
        b'"x":123456789012345678901234567890,"_ng_task_index":5,"_ng_rollout_index":0}\n'
    )


def test_a_non_finite_number_is_refused_by_both_passes_whatever_strict_json_says(tmp_path: Path) -> None:
    lines = [
        *_lines(),
        '{"responses_create_params": {"input": "n"}, "agent_ref": {"name": "arith_agent"}, "x": NaN}',
    ]
    fast, general = _both(_settings(tmp_path, lines, strict_json=False))
    assert fast == general
    assert fast[0] == "InputError"
    assert fast[1].endswith(f"line {len(lines)}: non-finite number NaN (not JSON); {NON_FINITE_HINT}")


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{bad", "line 25: malformed JSON"),
        ("", "line 25: blank line"),
        ('["a list"]', "line 25: the row "),
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
    assert sum(spec.num_rows for spec in iter_prepare_run(fast)) == 192
    assert used == [True]
    monkeypatch.setattr(shards, "proven_rows", lambda *args: None)
    general = _settings(tmp_path / "general", lines, num_repeats=2, shard_size=5)
    assert sum(spec.num_rows for spec in iter_prepare_run(general)) == 192
    planned = _planned(tmp_path / "fast" / "run")
    assert len(planned) == 2 * 32  # a task's 2 rollouts together, cut after 6 rows: 32 shards
    assert planned == _planned(tmp_path / "general" / "run")


def test_random_rows_written_by_json_are_stamped_to_json_s_text_of_the_stamped_row(tmp_path: Path) -> None:
    rng = random.Random(20261202)
    lines = []
    for k in range(300):
        extra = {"v": _random_value(rng), "w": [_random_value(rng) for _ in range(rng.randrange(3))]}
        if non_finite_problem(extra) is not None:  # refused whatever strict_json says: another test
            extra = {"v": None, "w": []}
        text = json.dumps(_row(f"q{k % 40}", **extra), ensure_ascii=rng.random() < 0.2, separators=(",", ":"))
        lines.append(text)
    kinds: Counter[str] = Counter()
    for start in range(0, 300, 2):  # files of 2 lines (a mark anywhere in a file holds its lines back)
        run = _settings(tmp_path / str(start), lines[start : start + 2], num_repeats=2)
        fast, general = _both(run)
        assert fast == general
        rows = proven_rows(run.settings, run.topology, None, lambda read: read, CompactIndex())
        assert rows is not None
        kinds.update(type(item).__name__ for item in rows)
    assert kinds["tuple"] > 0  # some rows stamped as read ...
    assert kinds["dict"] > 0  # ... and some encoded again
