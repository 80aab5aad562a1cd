"""Planning's fast paths against the forms they replace: the validation pass as one loop
(:mod:`gym_ray.plan._valid_lines`, also in the range process, :mod:`gym_ray.plan._range_child`) makes the
general chain's lookups in the same order, counts the same rows and raises the same errors; the dedupe's
block merge (``sorted_blocks`` + ``_block_groups``) finds the duplicates the value-by-value merge finds;
planned folders are byte-identical either way."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gym_ray.config.run_config import RunConfig
from gym_ray.errors import GymRayError
from gym_ray.plan import _parallel_pass, _spill_dedupe, first_pass
from gym_ray.plan._range_child import RangeJob, count_range
from gym_ray.plan._spill_dedupe import RangeRecorder, _block_groups, _Spiller
from gym_ray.plan._valid_lines import count_valid_lines
from gym_ray.plan._validate_pass import RowsInvalid, count_valid_rows, preprocess_knobs
from gym_ray.plan.load import Stopped, _load_jsonl_span, _load_jsonl_via, until_stopped
from gym_ray.plan.run_manifest import read_run_manifest
from gym_ray.plan.shards import prepare_run
from gym_ray.record.manifest import read_manifest
from tests.plan.test_common_rows import _config, _row, _varied_lines


def _groups(records: Iterable[int]) -> Iterator[tuple[int, list[int]]]:
    """The form ``_block_groups`` replaced, value by value (``_spill_dedupe._groups`` before issue 17's
    planning round): ``(first ordinal, later ordinals)`` of each digest seen more than once."""
    current: int | None = None
    ordinals: list[int] = []
    for record in records:
        digest, ordinal = record >> 40, record & ((1 << 40) - 1)
        if digest != current:
            if len(ordinals) > 1:
                yield ordinals[0], ordinals[1:]
            current, ordinals = digest, [ordinal]
        else:
            ordinals.append(ordinal)
    if len(ordinals) > 1:
        yield ordinals[0], ordinals[1:]


class _Keys:
    """A task numbering that keeps every lookup, in order (``add`` only: the loop hands them one by one)."""

    def __init__(self) -> None:
        self.keys: list[int] = []

    def add(self, key: int) -> int:
        self.keys.append(key)
        return len(self.keys) - 1


def _lines() -> list[str]:
    """Varied rows (general-path shapes, repeats, unicode and escapes, a block that is not plain)."""
    extra = [
        json.dumps(_row('é ✓ "q" \\ 😀 \n\t', n=-12, f=2.25), ensure_ascii=False),
        json.dumps(_row("esc ü")),  # "\u00fc": an escape
        json.dumps(_row("deep", deep=[[[[{"x": [[["y"]]]}]]]])),
        json.dumps(_row("big", n=1234567890123456789)),  # 19 digits: the block is not plain
        json.dumps(_row("q0", meta={"b": 1, "a": [1.5, "é"]}), ensure_ascii=False),
        '{"responses_create_params":{"input":"\\u006eull"},"agent_ref":{"name":"arith_agent"}}',  # "null"
        json.dumps(_row("nu\u006cl ok"), separators=(",", ":")),
    ]
    return (_varied_lines() + extra) * 3


def _write(path: Path, lines: list[str], *, bom: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + ("\n".join(lines) + "\n").encode())
    return path


def _outcome(make: Any) -> tuple[Any, ...]:
    numbering = _Keys()
    try:
        return ("ok", make(numbering), numbering.keys)
    except (GymRayError, RowsInvalid, Stopped) as exc:
        return (type(exc).__name__, str(exc), numbering.keys)


def _both(run: RunConfig, stop: threading.Event | None = None) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The loop's and the general chain's outcome over the whole file: count or error, and the lookups."""
    settings, topology = run.settings, run.topology

    def loop(numbering: _Keys) -> int | None:
        return count_valid_lines(settings, topology, numbering, stop=stop)

    def general(numbering: _Keys) -> int | None:
        rows = until_stopped(
            _load_jsonl_via(str(settings.input_jsonl_fpath), strict_json=settings.strict_json), stop
        )
        return count_valid_rows(rows, settings, topology, numbering)

    return _outcome(loop), _outcome(general)


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("repeats", [1, 3])
@pytest.mark.parametrize("bom", [False, True])
def test_the_loop_counts_and_numbers_as_the_general_chain(
    tmp_path: Path, strict: bool, repeats: int, bom: bool
) -> None:
    path = _write(tmp_path / "rows.jsonl", _lines(), bom=bom)
    run = _config(tmp_path, "run", path, num_repeats=repeats, strict_json=strict)
    fast, general = _both(run)
    assert fast == general
    assert fast[0] == "ok"
    assert fast[1] == 3 * 23 * repeats  # 23 input rows a round, each run `repeats` times
    assert len(fast[2]) == 3 * 21  # every row numbered by content but the two with their own task index
    # identical rows share a digest: q0 (three lines a round: respaced, written with ensure_ascii off),
    # q1 and the materialized row (twice each): 17 distinct
    assert len(set(fast[2])) == 17


@pytest.mark.parametrize(
    ("bad", "kind", "fragment"),
    [
        ("{bad", "InputError", "line 41: malformed JSON"),
        ("", "InputError", "line 41: blank line"),
        ('["a list"]', "InputError", "line 41: the row "),
        (
            '{"responses_create_params": {"input": "d"}, "agent_ref": {"name": "x"}, "a": 1, "a": 2}',
            "InputError",
            "line 41: duplicate key 'a'",
        ),
        (json.dumps(_row("q", agent="arith_agnet")), "RowsInvalid", "row 40"),
        (json.dumps(_row("q", _ng_task_index=-1)), "InputError", "_ng_task_index must be an integer >= 0"),
    ],
)
def test_a_bad_line_stops_both_alike(tmp_path: Path, bad: str, kind: str, fragment: str) -> None:
    lines = _lines()
    path = _write(tmp_path / "rows.jsonl", [*lines[:40], bad, *lines[40:]])
    fast, general = _both(_config(tmp_path, "run", path))
    assert fast == general
    assert fast[0] == kind
    assert fragment in fast[1]


def test_a_set_stop_stops_both_alike(tmp_path: Path) -> None:
    stop = threading.Event()
    stop.set()
    fast, general = _both(_config(tmp_path, "run", _write(tmp_path / "rows.jsonl", _lines())), stop)
    assert fast == general == ("Stopped", "stopped", [])


def test_limit_or_a_knob_that_rewrites_rows_is_left_to_the_general_chain(tmp_path: Path) -> None:
    path = _write(tmp_path / "rows.jsonl", _lines())
    for extra in ({"limit": 3}, {"num_repeats_add_seed": True}, {"agent_map": {"_default": "arith_agent"}}):
        run = _config(tmp_path, "run", path, **extra)
        numbering = _Keys()
        assert count_valid_lines(run.settings, run.topology, numbering) is None
        assert numbering.keys == []


@pytest.mark.parametrize("bad_at", [None, 5, 60])
def test_a_range_counts_and_records_as_the_general_chain_over_its_span(
    tmp_path: Path, bad_at: int | None
) -> None:
    """The range process's body over each byte range: the same count (or error) and the same files."""
    lines = _lines()
    if bad_at is not None:
        lines.insert(bad_at, json.dumps(_row("q", agent="nobody")))
    path = _write(tmp_path / "rows.jsonl", lines)
    run = _config(tmp_path, "run", path, num_repeats=2)
    settings, topology = run.settings, run.topology
    outcomes = []
    for start, end in _parallel_pass.split_ranges(str(path), 2):
        folder = tmp_path / f"r{start}"
        folder.mkdir()
        try:
            job = RangeJob(
                str(path), start, end, preprocess_knobs(settings), True, topology, str(folder), "fast"
            )
            count, runs, digests, lookups = count_range(job)
            fast: tuple[Any, ...] = (
                count,
                lookups,
                Path(digests).read_bytes(),
                [Path(r).read_bytes() for r in runs],
            )
        except RowsInvalid as exc:
            fast = ("invalid", str(exc))
        recorder = RangeRecorder(folder, "general")
        try:
            span = _load_jsonl_span(str(path), start, end, max_line_bytes=1 << 26, strict_json=True)
            counted = count_valid_rows(span, settings, topology, recorder)
            part = recorder.finish()
            general: tuple[Any, ...] = (
                counted,
                part.lookups,
                part.digests.read_bytes(),
                [r.read_bytes() for r in part.runs],
            )
        except RowsInvalid as exc:
            general = ("invalid", str(exc))
        finally:
            recorder.close()
        assert fast == general
        outcomes.append(fast[0])
    if bad_at is None:
        assert outcomes[0] + outcomes[1] == 2 * 3 * 23
    else:
        assert outcomes.count("invalid") == 1
        assert outcomes.index("invalid") == (0 if bad_at == 5 else 1)


def _planned(tmp_path: Path, name: str, input_path: Path, **extra: Any) -> list[Any]:
    """Every planned byte that does not carry the (random) run id or a time: inputs, manifests' plans."""
    plan = prepare_run(_config(tmp_path, name, input_path, **extra))
    run = read_run_manifest(tmp_path / name)
    assert run is not None
    out: list[Any] = [(run["num_shards"], run["planned"], run["run_rows"], run["shard_size"])]
    for spec in plan.shards:
        manifest = read_manifest(tmp_path / name, spec.shard)
        assert manifest is not None
        inputs = tmp_path / name / f"rollouts-{spec.shard}_materialized_inputs.jsonl"
        out.append(
            (
                spec.shard,
                spec.num_rows,
                spec.run_rows,
                inputs.read_bytes(),
                manifest.inputs_digest,
                manifest.attempt_plan,
            )
        )
    return out


def _old_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """The forms before the fast paths: the general validation chain, the value-by-value duplicate merge."""
    monkeypatch.setattr(first_pass, "count_valid_lines", lambda *args, **kwargs: None)

    def value_by_value(blocks: Any) -> Any:
        return _groups(value for block in blocks for value in block)

    monkeypatch.setattr(_spill_dedupe, "_block_groups", value_by_value)


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({"num_repeats": 2, "shard_size": 5}, id="repeats"),
        pytest.param(
            {"agent_map": {"_default": "arith_agent"}, "num_repeats": 2, "shard_size": 7}, id="rows-rewritten"
        ),
        pytest.param({"shard_size": 3}, id="one-repeat"),
    ],
)
@pytest.mark.filterwarnings("ignore:agent_map overrode agent_ref values")  # rows-rewritten: as meant
def test_planned_folders_are_byte_identical_to_the_old_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: dict[str, Any]
) -> None:
    path = _write(tmp_path / "rows.jsonl", _lines() * 2)
    new_one = _planned(tmp_path, "new-one", path, **extra)
    monkeypatch.setattr(_parallel_pass, "PROCESSES", 2)
    new_two = _planned(tmp_path, "new-two", path, **extra)  # a range in a spawned process
    monkeypatch.setattr(_parallel_pass, "PROCESSES", None)
    with monkeypatch.context() as patched:
        _old_paths(patched)
        old = _planned(tmp_path, "old", path, **extra)
    assert new_one == new_two == old
    assert len(old) > 5


@pytest.mark.parametrize("processes", [None, 2])
@pytest.mark.parametrize("bad_at", [3, 120])
def test_a_bad_row_in_either_range_gives_the_old_path_s_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, processes: int | None, bad_at: int
) -> None:
    lines = _lines() * 2
    lines.insert(bad_at, json.dumps(_row("q", agent="arith_agnet")))
    path = _write(tmp_path / "rows.jsonl", lines)
    with monkeypatch.context() as patched:
        _old_paths(patched)
        with pytest.raises(GymRayError) as old:
            prepare_run(_config(tmp_path, "old", path))
    assert "'arith_agnet' is not in the running config" in str(old.value)
    monkeypatch.setattr(_parallel_pass, "PROCESSES", processes)
    with pytest.raises(type(old.value)) as new:
        prepare_run(_config(tmp_path, "new", path))
    assert str(new.value) == str(old.value)
    assert not (tmp_path / "new").exists()  # nothing written
    assert not (tmp_path / "old").exists()


def test_the_block_merge_finds_the_duplicates_the_value_merge_finds(tmp_path: Path) -> None:
    rng = random.Random(17)
    digests = [rng.randrange(40) if rng.random() < 0.3 else rng.getrandbits(64) for _ in range(5000)]
    for chunk, runs_apart in ((7, 1), (64, 3), (10_000, 1)):  # > 64 runs, several adopted parts, no spill
        spillers = []
        for label in ("values", "blocks"):
            spiller = _Spiller(tmp_path, f"{label}-{chunk}", chunk)
            part = len(digests) // runs_apart
            for k in range(runs_apart):  # parts recorded apart, adopted with their ordinal offsets
                piece = digests[k * part : (k + 1) * part if k < runs_apart - 1 else None]
                if runs_apart == 1:
                    for ordinal, digest in enumerate(piece):
                        spiller.add((digest << 40) | ordinal)
                else:
                    recorder = _Spiller(tmp_path, f"{label}-{chunk}-part{k}", chunk)
                    recorder.add_many([(digest << 40) | ordinal for ordinal, digest in enumerate(piece)])
                    for path in recorder.spilled():
                        spiller.adopt(path, k * part)
            spillers.append(spiller)
        by_value = list(_groups(spillers[0].sorted()))
        blocks = list(spillers[1].sorted_blocks())
        assert [v for block in blocks for v in block] == sorted(
            (digest << 40) | ordinal for ordinal, digest in enumerate(digests)
        )
        assert list(_block_groups(blocks)) == by_value
        # an oracle: every digest seen more than once, its first ordinal and the later ones
        seen: dict[int, list[int]] = {}
        for ordinal, digest in enumerate(digests):
            seen.setdefault(digest, []).append(ordinal)
        expected = sorted(
            ((ordinals[0], ordinals[1:]) for ordinals in seen.values() if len(ordinals) > 1),
            key=lambda group: digests[group[0]],
        )
        assert by_value == expected
    # blocks cut anywhere, a group spanning several blocks
    records = sorted([(3 << 40) | k for k in range(10)] + [(1 << 40) | 50, (9 << 40) | 60, (9 << 40) | 61])
    for size in (1, 2, 3, 5, 13):
        cut = [records[i : i + size] for i in range(0, len(records), size)]
        assert list(_block_groups(cut)) == [(0, list(range(1, 10))), (60, [61])]
