"""Merging shards: order by (task, rollout, attempt), one success per identity, atomic outputs."""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import random
import re
from pathlib import Path
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.errors import ConfigError, InputError, RecordError
from gym_ray.finalize.merge import merge_shards
from gym_ray.record.jsonl import parse_record
from gym_ray.record.shard_files import shard_paths
from gym_ray.record.writer import ShardWriter


def rec(task: int, rollout: int, attempt: int = 0, **extra: Any) -> dict[str, Any]:
    record: dict[str, Any] = {keys.TASK_INDEX: task, keys.ROLLOUT_INDEX: rollout, **extra}
    if attempt:
        record[keys.ATTEMPT_INDEX] = attempt
    return record


def fail(task: int, rollout: int, attempt: int = 0, **extra: Any) -> dict[str, Any]:
    return rec(task, rollout, attempt, _ng_failure_class="agent_run_error", **extra)


def write_shard(run_dir: Path, shard: str, records: list[dict[str, Any]]) -> None:
    with ShardWriter(run_dir, shard, run_id="run-1", config_identity=None, record_omitted_rollouts=True) as w:
        for record in records:
            w.append(record)


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def crafted_run(run_dir: Path) -> None:
    write_shard(
        run_dir,
        "a",
        [
            rec(2, 0, src="a"),
            fail(0, 1, 0, src="a"),
            rec(0, 1, 1, src="a"),
            rec(0, 0, src="a"),
            fail(1, 0, 1, src="a"),
            fail(1, 0, 0, src="a"),
            rec(3, 0, _ng_failure_class="cancelled", _ng_no_persist=True),
        ],
    )
    write_shard(
        run_dir,
        "b",
        [
            rec(4, 0, src="b"),
            rec(0, 0, src="b"),
            fail(1, 1, 1, src="b"),
            rec(1, 1, 2, src="b"),
            fail(1, 1, 0, src="b"),
            fail(5, 0, 0, src="b", _ng_failure_terminal=True),
        ],
    )
    write_shard(run_dir, "c", [fail(6, 0, src="c"), fail(1, 0, 1, src="c"), rec(7, 0, src="c")])
    successes = shard_paths(run_dir, "c").successes
    with successes.open("ab") as handle:
        handle.write(b"garbage in the middle\n" + json.dumps(rec(8, 0, src="c")).encode() + b"\n{torn")


@pytest.mark.parametrize("fan_in", [pytest.param(2, id="fan-in-2"), pytest.param(64, id="fan-in-64")])
def test_merge_orders_and_deduplicates_exactly(tmp_path: Path, fan_in: int) -> None:
    crafted_run(tmp_path)
    result = merge_shards(tmp_path, fan_in=fan_in)
    assert read(tmp_path / "rollouts.jsonl") == [
        rec(0, 0, src="a"),
        rec(0, 1, 1, src="a"),
        rec(1, 1, 2, src="b"),
        rec(2, 0, src="a"),
        rec(4, 0, src="b"),
        rec(7, 0, src="c"),
        rec(8, 0, src="c"),
    ]
    assert read(tmp_path / "rollouts_failures.jsonl") == [
        fail(1, 0, 0, src="a"),
        fail(1, 0, 1, src="a"),
        fail(5, 0, 0, src="b", _ng_failure_terminal=True),
        fail(6, 0, src="c"),
    ]
    assert result.model_dump() == {
        "successes_path": tmp_path / "rollouts.jsonl",
        "failures_path": tmp_path / "rollouts_failures.jsonl",
        "shards": ("a", "b", "c"),
        "successes": 7,
        "failures": 4,
        "terminal_failures": 1,
        "duplicate_successes_dropped": 1,
        "superseded_failures_dropped": 3,
        "duplicate_failures_dropped": 1,
        "omitted_rows_skipped": 1,
        "corrupt_lines": 2,
    }
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def _reference_merge(shards: list[list[dict[str, Any]]]) -> tuple[list[Any], list[Any]]:
    """A plain in-memory statement of the merge rules, to check the streaming merge against."""
    entries = []
    for shard_no, records in enumerate(shards):
        for line_no, record in enumerate(records):
            if record.get(keys.NO_PERSIST):
                continue
            kind = 1 if keys.FAILURE_CLASS in record else 0
            key = (record[keys.TASK_INDEX], record[keys.ROLLOUT_INDEX])
            entries.append((key, kind, record.get(keys.ATTEMPT_INDEX, 0), shard_no, line_no, record))
    entries.sort(key=lambda entry: entry[:5])
    successes, failures, seen_success, seen_failure = [], [], set(), set()
    success_keys = {entry[0] for entry in entries if entry[1] == 0}
    for key, kind, attempt, _, _, record in entries:
        if kind == 0 and key not in seen_success:
            seen_success.add(key)
            successes.append(record)
        elif kind == 1 and key not in success_keys and (key, attempt) not in seen_failure:
            seen_failure.add((key, attempt))
            failures.append(record)
    return successes, failures


def _reference_counts(shards: list[list[dict[str, Any]]]) -> dict[str, int]:
    """The merge's counts, from the rules stated per identity (an oracle independent of the merge code)."""
    by_identity: dict[tuple[int, int], list[tuple[int, int, bool]]] = {}
    for records in shards:
        for record in records:
            if record.get(keys.NO_PERSIST):
                continue
            key = (record[keys.TASK_INDEX], record[keys.ROLLOUT_INDEX])
            kind = 1 if keys.FAILURE_CLASS in record else 0
            terminal = record.get(keys.FAILURE_TERMINAL) is True
            by_identity.setdefault(key, []).append((kind, record.get(keys.ATTEMPT_INDEX, 0), terminal))
    counts = dict.fromkeys(("successes", "failures", "terminal", "dup_ok", "superseded", "dup_failed"), 0)
    for lines in by_identity.values():
        ok = [line for line in lines if line[0] == 0]
        failed = sorted((line for line in lines if line[0] == 1), key=lambda line: line[1])
        if ok:
            counts["successes"] += 1
            counts["dup_ok"] += len(ok) - 1
            counts["superseded"] += len(failed)
            continue
        first_per_attempt = {attempt: terminal for _, attempt, terminal in reversed(failed)}
        counts["failures"] += len(first_per_attempt)
        counts["dup_failed"] += len(failed) - len(first_per_attempt)
        counts["terminal"] += any(first_per_attempt.values())
    return counts


def counts_of(result: Any) -> tuple[int, ...]:
    """A merge's six kept/dropped counts, in ``_reference_counts``' order."""
    return (
        result.successes,
        result.failures,
        result.terminal_failures,
        result.duplicate_successes_dropped,
        result.superseded_failures_dropped,
        result.duplicate_failures_dropped,
    )


@pytest.mark.parametrize("disjoint", [pytest.param(False, id="shared"), pytest.param(True, id="disjoint")])
@pytest.mark.parametrize("seed", [pytest.param(seed, id=f"seed-{seed}") for seed in range(4)])
def test_merge_matches_the_rules_on_random_runs(tmp_path: Path, seed: int, disjoint: bool) -> None:
    """Shards that share identities (the general merge) and shards that do not (each reduced alone)."""
    rng = random.Random(seed)
    shards: list[list[dict[str, Any]]] = []
    for shard_no in range(rng.randrange(1, 9)):
        records = []
        for line in range(rng.randrange(0, 40)):
            task, rollout, attempt = rng.randrange(12), rng.randrange(3), rng.randrange(3)
            task += 12 * shard_no * disjoint
            if rng.random() < 0.2:
                records.append(
                    fail(task, rollout, attempt, _ng_failure_terminal=True, src=f"{shard_no}:{line}")
                )
                continue
            tag = {"src": f"{shard_no}:{line}"}
            choice = rng.random()
            if choice < 0.5:
                records.append(rec(task, rollout, attempt, **tag))
            elif choice < 0.9:
                records.append(fail(task, rollout, attempt, **tag))
            else:
                records.append(rec(task, rollout, attempt, _ng_no_persist=True, **tag))
        shards.append(records)
        write_shard(tmp_path, f"shard-{shard_no:03d}", records)
    result = merge_shards(tmp_path, fan_in=3)
    expected_successes, expected_failures = _reference_merge(shards)
    assert read(tmp_path / "rollouts.jsonl") == expected_successes
    assert read(tmp_path / "rollouts_failures.jsonl") == expected_failures
    assert counts_of(result) == tuple(_reference_counts(shards).values())


def test_merge_replaces_previous_output_and_honours_the_prefix(tmp_path: Path) -> None:
    write_shard(tmp_path, "a", [rec(0, 0)])
    (tmp_path / "final.jsonl").write_text("old\n")
    result = merge_shards(tmp_path, output_prefix="final")
    assert result.successes_path == tmp_path / "final.jsonl"
    assert read(tmp_path / "final.jsonl") == [rec(0, 0)]
    assert (tmp_path / "final_failures.jsonl").read_bytes() == b""


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param({"reward": 1.0}, id="no-identity"),
        pytest.param({keys.TASK_INDEX: 1, keys.ROLLOUT_INDEX: "0"}, id="rollout-not-int"),
        pytest.param({keys.TASK_INDEX: 1.0, keys.ROLLOUT_INDEX: 0}, id="task-not-int"),
    ],
)
def test_record_without_identity_fails_the_merge_and_keeps_old_output(tmp_path: Path, bad: Any) -> None:
    write_shard(tmp_path, "a", [rec(0, 0), bad])
    (tmp_path / "rollouts.jsonl").write_text("old\n")
    with pytest.raises(
        InputError, match=r"rollouts-a\.jsonl:2: record has no integer _ng_task_index"
    ) as info:
        merge_shards(tmp_path)
    assert (info.value.path, info.value.line) == (str(shard_paths(tmp_path, "a").successes), 2)
    assert (tmp_path / "rollouts.jsonl").read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_merge_of_a_folder_without_shards_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="has no shard files") as info:
        merge_shards(tmp_path)
    assert info.value.path == str(tmp_path)


def test_counts_add_up_over_shards_and_shards_with_nothing_to_keep(tmp_path: Path) -> None:
    drained = {keys.FAILURE_CLASS: "cancelled", keys.NO_PERSIST: True}
    write_shard(tmp_path, "a", [rec(0, 0), fail(1, 0), fail(1, 0), rec(2, 0, **drained)])
    write_shard(tmp_path, "b", [rec(3, 0, **drained), rec(4, 0, **drained)])  # only omitted rows
    write_shard(tmp_path, "c", [fail(5, 0), fail(5, 0), fail(5, 0), fail(6, 0, _ng_failure_terminal=True)])
    for shard in ("a", "b", "c"):
        with shard_paths(tmp_path, shard).successes.open("ab") as handle:
            handle.write(b"not json\n")
    (tmp_path / "rollouts-d.jsonl").write_bytes(b"x")  # one torn byte: a shard of one corrupt line
    result = merge_shards(tmp_path)
    assert result.model_dump(exclude={"successes_path", "failures_path"}) == {
        "shards": ("a", "b", "c", "d"),
        "successes": 1,
        "failures": 3,
        "terminal_failures": 1,  # (6, 0), the last identity
        "duplicate_successes_dropped": 0,
        "superseded_failures_dropped": 0,
        "duplicate_failures_dropped": 3,  # one of (1, 0), two of (5, 0)
        "omitted_rows_skipped": 3,
        "corrupt_lines": 4,
    }


def test_a_failed_write_says_which_merged_files_may_be_new(tmp_path: Path) -> None:
    write_shard(tmp_path, "a", [rec(0, 0), fail(1, 0)])
    (tmp_path / "rollouts_failures.jsonl").write_text("old\n")
    (tmp_path / "rollouts.jsonl").mkdir()  # a folder where the successes go: replacing it fails
    with pytest.raises(RecordError) as info:
        merge_shards(tmp_path)
    assert str(info.value).startswith(f"merging the shards of {tmp_path} failed ([Errno 21] Is a directory")
    assert str(info.value).endswith(
        "; each merged file is its old or its new version (they are replaced one after the other, failures "
        "first). Fix the cause and merge again"
    )
    # the failures were replaced before the successes failed: the message says so, not "unchanged"
    assert read(tmp_path / "rollouts_failures.jsonl") == [fail(1, 0)]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_shard_file_that_is_not_a_regular_file_has_no_lines(tmp_path: Path) -> None:
    write_shard(tmp_path, "a", [rec(0, 0)])
    shard_paths(tmp_path, "a").failures.unlink()
    shard_paths(tmp_path, "a").failures.symlink_to("/dev/zero")  # endless: never read
    result = merge_shards(tmp_path)
    assert (result.successes, result.failures, result.corrupt_lines) == (1, 0, 0)


def test_argument_edges_are_accepted(tmp_path: Path) -> None:
    write_shard(tmp_path, "a", [rec(0, 0)])
    result = merge_shards(tmp_path, output_prefix="run.v2_final-1", fan_in=2, workers=1, pool_min_bytes=0)
    assert (result.successes, result.successes_path.name) == (1, "run.v2_final-1.jsonl")


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        pytest.param({"output_prefix": "../x"}, "output_prefix='../x'", id="prefix-traversal"),
        pytest.param({"output_prefix": "a..b"}, "output_prefix='a..b'", id="prefix-dotdot"),
        pytest.param({"output_prefix": 5}, "output_prefix=5", id="prefix-not-str"),
        pytest.param(
            {"output_prefix": "rollouts-all"}, "does not start with 'rollouts-'", id="prefix-shardlike"
        ),
        pytest.param({"fan_in": 1}, "fan_in=1", id="fan-in-1"),
        pytest.param({"workers": 0}, "workers=0 must be an integer >= 1", id="workers-0"),
        pytest.param({"workers": 2.0}, "workers=2.0 must be an integer >= 1", id="workers-float"),
        pytest.param({"pool_min_bytes": -1}, "pool_min_bytes=-1 must be an integer >= 0", id="pool-min-neg"),
    ],
)
def test_merge_rejects_bad_arguments(tmp_path: Path, kwargs: dict[str, Any], fragment: str) -> None:
    write_shard(tmp_path, "a", [rec(0, 0)])
    with pytest.raises(ConfigError, match=re.escape(fragment)) as info:
        merge_shards(tmp_path, **kwargs)
    assert info.value.key == next(iter(kwargs))


def write_lines(run_dir: Path, name: str, lines: list[bytes]) -> None:
    (run_dir / name).write_bytes(b"".join(lines))


def test_nested_identity_keys_do_not_stand_in_for_top_level_ones(tmp_path: Path) -> None:
    nested = {keys.TASK_INDEX: 99, keys.ROLLOUT_INDEX: 99, keys.ATTEMPT_INDEX: 7}
    write_shard(
        tmp_path,
        "a",
        [
            rec(1, 0, meta=nested),
            fail(0, 0, 0, meta=nested, note='"_ng_attempt_index":5'),
            fail(0, 0, 0, meta=nested),
            fail(0, 0, 2, meta={keys.FAILURE_TERMINAL: True, keys.NO_PERSIST: True}),
        ],
    )
    result = merge_shards(tmp_path)
    assert read(tmp_path / "rollouts.jsonl") == [rec(1, 0, meta=nested)]
    assert read(tmp_path / "rollouts_failures.jsonl") == [
        fail(0, 0, 0, meta=nested, note='"_ng_attempt_index":5'),
        fail(0, 0, 2, meta={keys.FAILURE_TERMINAL: True, keys.NO_PERSIST: True}),
    ]
    assert (result.duplicate_failures_dropped, result.terminal_failures, result.omitted_rows_skipped) == (
        1,
        0,
        0,
    )


def test_nested_identity_without_top_level_identity_is_an_input_error(tmp_path: Path) -> None:
    write_lines(tmp_path, "rollouts-a.jsonl", [b'{"meta":{"_ng_task_index":1,"_ng_rollout_index":0}}\n'])
    with pytest.raises(InputError, match=r"rollouts-a\.jsonl:1: record has no integer _ng_task_index"):
        merge_shards(tmp_path)


def test_output_lines_are_the_shard_lines_byte_for_byte(tmp_path: Path) -> None:
    # Spacing, key order, escapes, non-ASCII text, repeated keys and a missing final newline survive as-is.
    a_lines = [
        b'{ "_ng_rollout_index" : 0, "_ng_task_index" : 2, "text": "caf\\u00e9 \xc3\xa9" }\n',
        b'{"_ng_task_index":0,"_ng_rollout_index":0,"x":1.50,"x":2}\n',
        b"\n",
        b'\t{"_ng_task_index":1,"_ng_rollout_index":0,"big":1e400,"n":NaN}  \n',
    ]
    write_lines(tmp_path, "rollouts-a.jsonl", a_lines)
    write_lines(tmp_path, "rollouts-b.jsonl", [b'{"_ng_task_index":3,"_ng_rollout_index":0,"z":[]}'])
    write_lines(
        tmp_path,
        "rollouts-b_failures.jsonl",
        [b'{"_ng_task_index":4,"_ng_rollout_index":1,"_ng_failure_class":"cancelled","s":"\\ud800"}\n'],
    )
    result = merge_shards(tmp_path)
    assert (tmp_path / "rollouts.jsonl").read_bytes() == b"".join(
        [a_lines[1], a_lines[3], a_lines[0], b'{"_ng_task_index":3,"_ng_rollout_index":0,"z":[]}\n']
    )
    assert (tmp_path / "rollouts_failures.jsonl").read_bytes() == (
        b'{"_ng_task_index":4,"_ng_rollout_index":1,"_ng_failure_class":"cancelled","s":"\\ud800"}\n'
    )
    assert (result.successes, result.failures, result.corrupt_lines) == (4, 1, 0)


@pytest.mark.parametrize(
    "indices",
    [
        pytest.param([-(2**70), 2**64, -5, 0, 2**63, -(2**63), 2**63 - 1, 10**30], id="outside-int64"),
        pytest.param([2**200, 3, 2**200 + 1, -(2**300)], id="very-wide"),
    ],
)
def test_indices_of_any_size_order_like_integers(tmp_path: Path, indices: list[int]) -> None:
    shards = [[rec(t, t % 3 if t >= 0 else 0, src="a") for t in indices[::2]]]
    shards.append([fail(t, 1, attempt=abs(t) % 5, src="b") for t in indices[1::2]] + [rec(indices[0], 0)])
    for number, records in enumerate(shards):
        write_shard(tmp_path, f"s{number}", records)
    merge_shards(tmp_path, fan_in=2)
    expected_successes, expected_failures = _reference_merge(shards)
    assert read(tmp_path / "rollouts.jsonl") == expected_successes
    assert read(tmp_path / "rollouts_failures.jsonl") == expected_failures
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("shard_count", [pytest.param(1, id="one-shard"), pytest.param(5, id="five-shards")])
def test_disjoint_and_overlapping_shards_merge_alike(tmp_path: Path, shard_count: int) -> None:
    disjoint = [
        [rec(t, r, src=f"{n}") for t in range(n * 10 + 9, n * 10 - 1, -1) for r in (1, 0)]
        for n in range(shard_count)
    ]
    overlapping = [
        [rec(t, r, src=f"{n}") for t in range(9, -1, -1) for r in (1, 0)] for n in range(shard_count)
    ]
    for name, shards in (("d", disjoint), ("o", overlapping)):
        run_dir = tmp_path / name
        run_dir.mkdir()
        for number, records in enumerate(shards):
            write_shard(run_dir, f"s{number}", records)
        result = merge_shards(run_dir, fan_in=2)
        expected_successes, _ = _reference_merge(shards)
        assert read(run_dir / "rollouts.jsonl") == expected_successes
        assert result.duplicate_successes_dropped == (0 if name == "d" else 20 * (shard_count - 1))


def _mutations(seed: int, count: int) -> list[bytes]:
    rng = random.Random(seed)
    base = [
        json.dumps(
            rec(3, 1, 2, text="ab\u00e9", n=[1.5, None, True], o={"k": "v"}), ensure_ascii=False
        ).encode(),
        json.dumps(fail(3, 1, 0, _ng_failure_terminal=True, e=-0.0, u="\\u00e9")).encode(),
    ]
    alphabet = b'{}[]":,0123456789.eE+-tfnulNaI\\ \t\r\x00\x7f\xc3\xa9\xed\xff'
    lines = []
    for _ in range(count):
        line = bytearray(rng.choice(base))
        for _ in range(rng.randrange(1, 3)):
            position = rng.randrange(len(line))
            choice = rng.random()
            if choice < 0.4:
                line[position] = rng.choice(alphabet)
            elif choice < 0.7:
                del line[position]
            else:
                line.insert(position, rng.choice(alphabet))
        lines.append(bytes(line).replace(b"\n", b" "))
    return lines


def test_merge_classifies_mutated_lines_like_the_jsonl_reader(tmp_path: Path) -> None:
    """The fast parser reaches parse_record's verdict (record or corrupt) and reads the same keys."""
    lines = _mutations(seed=7, count=400)
    for index, line in enumerate(lines):
        run_dir = tmp_path / f"case-{index}"
        run_dir.mkdir()
        write_lines(run_dir, "rollouts-a.jsonl", [line + b"\n"])
        record = parse_record(line)
        if record is None:
            assert merge_shards(run_dir).corrupt_lines == 1, line
            continue
        if type(record.get(keys.TASK_INDEX)) is not int or type(record.get(keys.ROLLOUT_INDEX)) is not int:
            with pytest.raises(InputError):
                merge_shards(run_dir)
            continue
        result = merge_shards(run_dir)
        assert (result.successes, result.corrupt_lines) == (1, 0), line
        assert (run_dir / "rollouts.jsonl").read_bytes() == line + b"\n"


def wide_and_crafted_run(run_dir: Path) -> None:
    """crafted_run plus shards whose indices need the wide key layout (a retry inside the merge)."""
    crafted_run(run_dir)
    write_shard(run_dir, "d", [rec(2**70, 0, src="d"), fail(-(2**65), 1, attempt=3, src="d"), rec(0, 0)])
    write_shard(run_dir, "e", [rec(t, r, src="e") for t in range(30, 10, -1) for r in (2, 0, 1)])


def merged_bytes(run_dir: Path) -> tuple[bytes, bytes]:
    return (run_dir / "rollouts.jsonl").read_bytes(), (run_dir / "rollouts_failures.jsonl").read_bytes()


def test_process_pool_writes_the_same_bytes_and_counts_as_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wide_and_crafted_run(tmp_path)
    in_process = merge_shards(tmp_path, fan_in=2, workers=1)
    expected = merged_bytes(tmp_path)
    (tmp_path / "rollouts.jsonl").write_text("old\n")
    sorted_in_pool: list[str] = []

    class CountingPool(concurrent.futures.ProcessPoolExecutor):
        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            sorted_in_pool.append(args[1])  # the shard label
            return super().submit(fn, *args, **kwargs)

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", CountingPool)
    pooled = merge_shards(tmp_path, fan_in=2, workers=2, pool_min_bytes=0)
    # every shard read in the pool once per pass: reduced alone, then (the shards share identities) sorted
    # for the general merge, which the wide indices restart once
    assert sorted_in_pool == [*in_process.shards, *in_process.shards, *in_process.shards]
    assert merged_bytes(tmp_path) == expected
    assert pooled == in_process
    assert (pooled.successes, pooled.failures, pooled.corrupt_lines, pooled.omitted_rows_skipped) == (
        68,
        5,
        2,
        1,
    )
    assert multiprocessing.active_children() == []
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_shards_without_shared_identities_are_each_read_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The usual run (each shard a block of tasks) is merged in one pass over the shards, not two."""
    shards = [
        [rec(t, r, src=f"{n}") for t in range(n * 10 + 9, n * 10 - 1, -1) for r in (1, 0)] for n in range(3)
    ]
    shards[1] += [fail(12, 0, 0, _ng_failure_terminal=True), fail(19, 1, 0), rec(15, 0, src="again")]
    for number, records in enumerate(shards):
        write_shard(tmp_path, f"s{number}", records)
    read_in_pool: list[str] = []

    class CountingPool(concurrent.futures.ProcessPoolExecutor):
        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            read_in_pool.append(args[1])  # the shard label
            return super().submit(fn, *args, **kwargs)

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", CountingPool)
    result = merge_shards(tmp_path, workers=2, pool_min_bytes=0)
    assert read_in_pool == ["s0", "s1", "s2"]
    assert read(tmp_path / "rollouts.jsonl") == _reference_merge(shards)[0]
    assert (result.successes, result.duplicate_successes_dropped, result.superseded_failures_dropped) == (
        60,
        1,
        2,
    )


def test_error_in_a_pool_process_surfaces_like_in_process(tmp_path: Path) -> None:
    """The first failing shard in shard order raises, with the same type and message; nothing is left."""
    write_shard(tmp_path, "a", [rec(0, 0)])
    write_shard(tmp_path, "b", [rec(1, 0), rec(1, 1), {"reward": 1.0}])
    write_shard(tmp_path, "c", [{"reward": 0.0}])
    (tmp_path / "rollouts.jsonl").write_text("old\n")
    messages = []
    for kwargs in ({"workers": 1}, {"workers": 2, "pool_min_bytes": 0}):
        with pytest.raises(InputError) as info:
            merge_shards(tmp_path, **kwargs)
        assert type(info.value) is InputError
        assert (info.value.path, info.value.line) == (str(shard_paths(tmp_path, "b").successes), 3)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    assert re.search(r"rollouts-b\.jsonl:3: record has no integer _ng_task_index", messages[1])
    assert (tmp_path / "rollouts.jsonl").read_text() == "old\n"
    assert multiprocessing.active_children() == []
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize(
    "records",
    [
        pytest.param(
            [rec(0, 2**100, src="a"), rec(0, 1), rec(0, 2**100 + 1), fail(0, -(2**99)), rec(0, -(2**99) - 1)],
            id="huge-rollout",
        ),
        pytest.param(
            [fail(1, 0, 2**90), fail(1, 0, 3), fail(1, 0, 2**90 - 1), fail(0, 5, 2**91), fail(0, 5, 1)],
            id="huge-attempt",
        ),
        pytest.param(
            # each at the edge of a width: 2**(4w-1) needs w+1 hex digits, 2**(4w-1) - 1 needs w
            # (the layout widens 16 -> 32 -> 64 -> 128 digits here; -(2**510) - n are in its lowest quarter)
            [rec(v, 0) for v in (2**127 - 1, 2**127, -(2**127), -(2**127) - 1, 2**255, -(2**255) - 1, 7)]
            + [rec(-(2**510) - n, 0) for n in (1, 5, 3)]
            + [rec(7, v) for v in (2**203, -(2**203) - 1, 2**203 - 1)],
            id="width-edges",
        ),
        pytest.param(
            # one index wider than twice the first layout: the layout is sized by what that index needs
            [
                rec(2**200, 0),
                fail(2**200, 1, 1),
                rec(5, 0),
                fail(5, 1, 2),
                rec(2**200 - 1, 1),
                fail(-(2**200), 0),
            ],
            id="one-huge-index",
        ),
    ],
)
def test_huge_rollout_and_attempt_indices_order_like_integers(tmp_path: Path, records: list[Any]) -> None:
    shards = [records[::2], records[1::2]]
    for number, shard in enumerate(shards):
        write_shard(tmp_path, f"s{number}", shard)
    merge_shards(tmp_path, fan_in=2)
    expected_successes, expected_failures = _reference_merge(shards)
    assert read(tmp_path / "rollouts.jsonl") == expected_successes
    assert read(tmp_path / "rollouts_failures.jsonl") == expected_failures


def test_more_lines_than_one_write_batch_are_all_written_in_order(tmp_path: Path) -> None:
    # 4,096 lines are buffered per write: 5,000 successes and 5,000 failures take two batches each; the
    # shard file (2.5 MB) is read in three 1 MiB chunks, lines cut across chunk ends
    pad = "p" * 200
    successes = [rec(t, 0, n=t, pad=pad) for t in range(4999, -1, -1)]
    failures = [fail(t, 1, n=t, pad=pad) for t in range(5000)]
    write_shard(tmp_path, "a", successes + failures)
    result = merge_shards(tmp_path)
    assert (result.successes, result.failures) == (5000, 5000)
    assert [r["n"] for r in read(tmp_path / "rollouts.jsonl")] == list(range(5000))
    assert [r["n"] for r in read(tmp_path / "rollouts_failures.jsonl")] == list(range(5000))


class _PoolAsked(Exception):
    pass


@pytest.mark.parametrize(
    ("workers", "threshold", "expected"),
    [
        # the pool has one process fewer than the workers asked for: this process sorts shards too
        pytest.param(2, -1, 1, id="above-threshold"),
        pytest.param(2, 0, None, id="at-threshold"),
        pytest.param(5, -1, 2, id="one-per-shard"),
        pytest.param(None, -1, min(len(os.sched_getaffinity(0)), 3) - 1, id="one-per-cpu"),
        pytest.param(1, -1, None, id="one-worker"),
    ],
)
def test_a_process_pool_is_started_only_above_pool_min_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int | None, threshold: int, expected: int | None
) -> None:
    """The pool decision alone: the pool's own output is pinned by the (slower) spawn-pool tests."""
    write_shard(tmp_path, "a", [rec(0, 0), fail(1, 0)])
    write_shard(tmp_path, "b", [rec(2, 0)])
    write_shard(tmp_path, "c", [fail(3, 0), fail(4, 0)])
    shard_bytes = sum(p.stat().st_size for p in tmp_path.glob("rollouts-*.jsonl"))
    asked: list[tuple[int, str]] = []

    def no_spawn(*, max_workers: int, mp_context: Any) -> None:
        asked.append((max_workers, mp_context.get_start_method()))
        raise _PoolAsked

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", no_spawn)
    if expected is None:
        assert merge_shards(tmp_path, workers=workers, pool_min_bytes=shard_bytes + threshold).successes == 2
        assert asked == []
    else:
        with pytest.raises(_PoolAsked):
            merge_shards(tmp_path, workers=workers, pool_min_bytes=shard_bytes + threshold)
        assert asked == [(expected, "spawn")]  # spawn: a forked child would inherit the caller's threads


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize(
    "blocks",
    [
        pytest.param([0, 1, 2, 3, 4, 5], id="label-order"),
        pytest.param([5, 4, 3, 2, 1, 0], id="reversed"),
        pytest.param([0, 1, 2, 5, 3, 4], id="out-of-order-midway"),
        pytest.param([0, 1, None, 2, None, 3], id="empty-shards-between"),
    ],
)
def test_disjoint_shards_are_concatenated_in_identity_order_whatever_their_labels(
    tmp_path: Path, blocks: list[int | None], workers: int
) -> None:
    # Shard n holds the tasks of block blocks[n] (10 tasks each, a success and a failure-only identity per
    # task, lines out of order) or nothing. The merge appends shards while their ranges rise in label
    # order and concatenates again when they stop rising: the bytes are the reference merge's either way.
    shards: list[list[dict[str, Any]]] = []
    for number, block in enumerate(blocks):
        records: list[dict[str, Any]] = []
        if block is not None:
            for task in range(block * 10 + 9, block * 10 - 1, -1):
                records += [rec(task, 0, src=f"{number}"), fail(task, 1, 0, src=f"{number}")]
        shards.append(records)
        write_shard(tmp_path, f"s{number}", records)
    result = merge_shards(tmp_path, workers=workers, pool_min_bytes=0)
    expected_successes, expected_failures = _reference_merge(shards)
    assert read(tmp_path / "rollouts.jsonl") == expected_successes
    assert read(tmp_path / "rollouts_failures.jsonl") == expected_failures
    assert counts_of(result) == tuple(_reference_counts(shards).values())
    tasks = [
        json.loads(line)["_ng_task_index"] for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()
    ]
    assert tasks == sorted(t for b in blocks if b is not None for t in range(10 * b, 10 * b + 10))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
