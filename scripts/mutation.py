#!/usr/bin/env python
"""Mutation testing of gym_ray's core with mutmut: which small bugs does the suite not notice?

Usage (from the repository root; ``pip install -e ".[mutation]"`` first)::

    python scripts/mutation.py                         # every module below, 60 minutes in all
    python scripts/mutation.py --budget-min 20 record/ledger.py plan/resume.py
    python scripts/mutation.py --report                # print the report of what has run so far

Why mutmut (3.x): it is maintained, and it forks each mutant's test run from a process that has already
imported the package and collected the tests, so a mutant costs the tests that cover it and nothing else.
On this shared 2-core machine importing gym_ray and starting pytest alone takes 8-17 s of wall time, which
made cosmic-ray (a fresh test process per mutant; tried first) ~17 s per mutant against ~1 s here. mutmut
also runs only the tests that executed the mutated function, and keeps its results on disk, so a rerun
checks only the mutants without a result (incremental; a changed function gets new mutants).

How: each module gets its own work folder ``<work>/<module>/`` holding a copy of the tracked files (files
are copied only when their bytes changed, so results stay valid) and a ``pyproject.toml`` whose
``[tool.mutmut]`` names the module and its tests (per-module test selection: ``MODULES`` below). mutmut
mutates a copy in ``<work>/<module>/mutants/``, so the checkout you work in is never touched. The time
budget is shared between the modules still to run; a module whose slice runs out resumes next time.
The report (``<work>/report.md`` and ``summary.json``, also printed) gives killed / checked per module and
every survivor with its diff, for triage. Not part of CI's default run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mutation_triage import TRIAGED

ROOT = Path(__file__).resolve().parent.parent

#: module (under gym_ray/) -> the tests that cover it (per-module selection keeps each mutant run short).
#: An entry starting with ``-`` deselects that test (a slow test whose mutants faster tests kill too).
MODULES: dict[str, tuple[str, ...]] = {
    "record/ledger.py": (
        "tests/record/test_ledger.py",
        "tests/record/test_contracts.py::test_ledger_counts_every_extra_line_of_triplicates_and_several_"
        "duplicated_identities",
    ),
    "_json.py": ("tests/test_json_equivalence.py", "tests/record/test_records.py"),
    "plan/resume.py": (
        "tests/plan/test_resume.py",
        "tests/plan/test_resume_messages.py",
        "tests/plan/test_resume_counts.py",
    ),
    "record/merge.py": (
        "tests/record/test_merge.py",
        "tests/record/test_merge_shard.py",
        # 400 merges (5 s) covering every function: it pins the fast parser's verdicts, which the crafted
        # and random runs check too
        "-tests/record/test_merge.py::test_merge_classifies_mutated_lines_like_the_jsonl_reader",
        # spawn-pool tests (15 s each under mutmut: every pool process imports the mutated package); the
        # pool-only branches they cover are triaged by hand in docs/mutation.md
        "-tests/record/test_merge.py::test_process_pool_writes_the_same_bytes_and_counts_as_in_process",
        "-tests/record/test_merge.py::test_error_in_a_pool_process_surfaces_like_in_process",
    ),
    "record/_merge_shard.py": (
        "tests/record/test_merge.py",
        "tests/record/test_merge_shard.py",
        # spawn-pool tests (15 s each under mutmut: every pool process imports the mutated package); the
        # per-shard functions they run in a pool run in-process in every other test
        "-tests/record/test_merge.py::test_process_pool_writes_the_same_bytes_and_counts_as_in_process",
        "-tests/record/test_merge.py::test_error_in_a_pool_process_surfaces_like_in_process",
    ),
    "record/writer.py": (
        "tests/record/test_records.py",
        "tests/record/test_contracts.py",
        "tests/record/test_writer_takeover.py",
    ),
    "record/shard_files.py": (
        "tests/record/test_shard_files.py",
        "tests/record/test_records.py",
        "tests/chaos/test_shard_lock.py",
    ),
    "record/recording.py": ("tests/dispatch/test_helper_record.py", "tests/record/test_recording.py"),
    "plan/validation.py": (
        "tests/plan/test_preprocess_validation.py",
        "tests/plan/test_validation_messages.py",
        "tests/plan/test_validation_contract.py",
        "tests/dispatch/test_contracts.py",
    ),
    "record/aggregate.py": (
        "tests/record/test_aggregate_run.py",
        "tests/record/test_aggregate.py",
        "tests/record/test_contracts.py",
    ),
    "record/_aggregate_spool.py": (
        "tests/record/test_aggregate_spool.py",
        "tests/record/test_aggregate.py",
        "tests/record/test_aggregate_run.py",
        "tests/record/test_aggregate_encoding.py",
        "tests/record/test_aggregate_memory.py",
        "tests/record/test_contracts.py::test_aggregation_sends_a_stamped_rollout_to_its_stamp_when_the_agent_s_"
        "front_differs",
        # tracemalloc bounds (13 s and 3 s): they measure memory; faster tests pin the bytes they check
        "-tests/record/test_aggregate_memory.py::test_whole_call_memory_does_not_grow_with_the_tasks",
        "-tests/record/test_aggregate_memory.py::test_request_side_memory_does_not_grow_with_the_results",
    ),
    "dispatch/engine.py": (
        # the engine's contract on the reference servers and its pure parts (milliseconds per test)
        "tests/dispatch/test_engine_contracts.py",
        "tests/dispatch/test_dispatch.py",
        "tests/dispatch/test_contracts.py",
        "tests/dispatch/test_latency.py",
        "tests/dispatch/test_health.py",
        "tests/dispatch/test_helper_record.py",
        "tests/observe/test_tracing.py",
        # the bound on live tasks is the completion iterator's (its own selection runs the 1.7 s generator
        # test); engine mutants these kill, the faster tests kill too
        "-tests/dispatch/test_dispatch.py::test_many_generator_rows_keep_live_tasks_within_256[2560-in-ci]",
        "-tests/dispatch/test_dispatch.py::test_generator_rows_keep_live_tasks_bounded",
        # 1.4 s of client backoff; test_engine_contracts.py checks the replay count with 10 ms backoff
        "-tests/dispatch/test_dispatch.py::test_retry_requests_false_never_replays_run[replayed]",
        # a mutant that never ends the resend loop spins this test (Retry-After on a fake clock) into
        # pytest's 120 s timeout; test_engine_contracts.py checks the resend count under a 30 s limit
        "-tests/dispatch/test_health.py::test_retry_after_pauses_admission_and_429s_spend_the_infra_budget_not_attempts",
    ),
    "dispatch/_completion.py": (
        # the admission contract on plain coroutines (milliseconds per test)
        "tests/dispatch/test_completion_iterator.py",
        # the iterator's own tests (bare and through the helper, real servers); test_dispatch.py's 30 other
        # tests cover it too but cost 20-30 s per surviving mutant on this machine
        "tests/dispatch/test_dispatch_close.py",
        "tests/dispatch/test_dispatch.py::test_rows_start_in_input_order",
        "tests/dispatch/test_dispatch.py::test_generator_rows_keep_live_tasks_bounded",
        # 200k rows (8 s): the bound on resident tasks is checked by the generator test above
        "-tests/dispatch/test_dispatch_close.py::test_200k_generator_rows_keep_live_tasks_bounded_without_http",
    ),
    "distributed/driver.py": ("tests/distributed/test_distributed_driver.py",),
}
#: mutmut's exit code -> outcome (``mutmut.stats.status_by_exit_code``; unknown codes are "suspicious").
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped"}
STATUS |= {code: "timeout" for code in (24, -24, 36, 152, 255)}


def _folder(work: Path, module: str) -> Path:
    return work / module.replace("/", "__").removesuffix(".py")


def _sync(dest: Path) -> None:
    """Copy the tracked (and new, unignored) files to ``dest``, each only when its bytes changed."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    for rel in listed:
        src, dst = ROOT / rel, dest / rel
        if not src.is_file() or (dst.is_file() and dst.read_bytes() == src.read_bytes()):
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)


def _selection(module: str) -> list[str]:
    """The module's pytest arguments: its test paths, and ``--deselect <id>`` for each ``-<id>`` entry."""
    args: list[str] = []
    for entry in MODULES[module]:
        args += ["--deselect", entry[1:]] if entry.startswith("-") else [entry]
    return args


def _configure(folder: Path, module: str) -> None:
    tests = json.dumps(_selection(module))
    section = (
        "\n[tool.mutmut]\n"
        f'source_paths = ["gym_ray/{module}"]\n'
        'also_copy = ["gym_ray", "tests"]\n'
        f"pytest_add_cli_args_test_selection = {tests}\n"
        'pytest_add_cli_args = ["-p", "no:cacheprovider"]\n'
        # debug: pytest's own output in mutmut-run.log (without it a failing clean run says only "failed")
        "debug = true\n"
    )
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8") + section
    path = folder / "pyproject.toml"
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


def _env(folder: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(folder / "mutants")  # the mutated copy, never the editable install
    return env


def _tests_changed(folder: Path, module: str) -> bool:
    """True (once) when the module's test files changed since the last run: survivors are checked again."""
    digest = hashlib.sha256()
    for test in MODULES[module]:
        path = test.removeprefix("-").split("::")[0]
        digest.update(path.encode() + b"\0" + (ROOT / path).read_bytes())
    stamp = folder / "tests.sha256"
    changed = stamp.exists() and stamp.read_text() != digest.hexdigest()
    stamp.write_text(digest.hexdigest())
    return changed


def _survivors(folder: Path, module: str) -> list[str]:
    meta = folder / "mutants" / "gym_ray" / (module + ".meta")
    if not meta.exists():
        return []
    codes: dict[str, int | None] = json.loads(meta.read_text(encoding="utf-8"))["exit_code_by_key"]
    return sorted(key for key, code in codes.items() if code == 0)


def _run(folder: Path, seconds: float, names: list[str] | None = None) -> bool:
    """``mutmut run`` (of ``names`` only, when given) for at most ``seconds``; True when it finished."""
    with (folder / "mutmut-run.log").open("ab") as log:
        proc = subprocess.Popen(
            ["mutmut", "run", "--max-children", "1", *(names or [])],
            cwd=folder,
            env=_env(folder),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=max(seconds, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            return False
    return proc.returncode == 0


_DIFFS = """
import json, sys
from mutmut.mutation.diff_apply import find_mutant, get_diff_for_mutant
print(json.dumps({n: get_diff_for_mutant(n, path=find_mutant(n).path) for n in sys.argv[1:]}))
"""
_STRING = re.compile(r"""(?:[rbfu]{0,2})("[^"]*"|'[^']*')""", re.IGNORECASE)


def _message_only(diff: str) -> bool:
    """True when a mutant changes nothing but the text of string literals (an error message's wording)."""
    removed = [line[1:] for line in diff.splitlines() if line.startswith("-") and not line.startswith("---")]
    added = [line[1:] for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]

    def blank(lines: list[str]) -> list[str]:  # literals with a space are prose; keys and names are not
        return [_STRING.sub(lambda m: '""' if " " in m.group(1) else m.group(0), x).strip() for x in lines]

    return bool(removed) and blank(removed) == blank(added)


def _results(folder: Path, module: str) -> dict[str, Any]:
    meta = folder / "mutants" / "gym_ray" / (module + ".meta")
    if not meta.exists():
        return {"checked": 0}
    codes: dict[str, int | None] = json.loads(meta.read_text(encoding="utf-8"))["exit_code_by_key"]
    counts: dict[str, int] = {}
    for code in codes.values():
        status = "not checked" if code is None else STATUS.get(code, "suspicious")
        counts[status] = counts.get(status, 0) + 1
    names = sorted(key for key, code in codes.items() if code == 0)
    # every survivor's diff from one process (``mutmut show`` per mutant costs seconds each here)
    shown = subprocess.run(
        [sys.executable, "-c", _DIFFS, *names], cwd=folder, env=_env(folder), capture_output=True, text=True
    )
    diffs: dict[str, str] = json.loads(shown.stdout) if shown.returncode == 0 else {}
    prefix = "gym_ray." + module.removesuffix(".py").replace("/", ".") + "."
    triaged = TRIAGED.get(module, {})
    survivors = []
    for key in names:
        diff = diffs.get(key, "(diff unavailable: run `mutmut show` in the module's work folder)").strip()
        reason = triaged.get(key.removeprefix(prefix))
        survivors.append(
            {"mutant": key, "diff": diff, "message_only": _message_only(diff), "triaged": reason}
        )
    killed, survived = counts.get("killed", 0), counts.get("survived", 0)
    wording = sum(1 for s in survivors if s["message_only"])
    surviving = {key.removeprefix(prefix) for key in names}
    return {
        "counts": counts,
        "killed": killed,
        "checked": killed + survived,
        "message_only_survivors": wording,
        "triaged_survivors": sum(1 for s in survivors if s["triaged"] and not s["message_only"]),
        "stale_triage": sorted(set(triaged) - surviving),  # killed now, or renumbered: check them again
        "total": len(codes),
        "survivors": survivors,
    }


def _report(work: Path, modules: list[str]) -> str:
    lines = [
        "# Mutation report (mutmut)",
        "",
        "Score = killed / (killed + survived). The second score leaves out survivors that change only the",
        "wording of a string literal (error-message text: tests pin the parts a user acts on, the file,",
        "line, key or row, with `match=`, not every word). The third also leaves out the survivors triaged",
        "by hand in `scripts/mutation_triage.py` (equivalent, or covered by a test the run deselects).",
        "",
        "| module | killed / checked | score | without wording-only | without wording and triaged "
        "| other outcomes | not checked yet |",
        "|---|---|---|---|---|---|---|",
    ]
    details: list[str] = []
    summary: dict[str, Any] = {}
    for module in modules:
        r = _results(_folder(work, module), module)
        if not r["checked"]:
            lines.append(f"| {module} | not run | | | | | |")
            continue
        counts = r["counts"]
        others = ", ".join(
            f"{k} {v}" for k, v in sorted(counts.items()) if k not in ("killed", "survived", "not checked")
        )
        score = f"{100.0 * r['killed'] / r['checked']:.1f}%"
        logic = r["checked"] - r["message_only_survivors"]
        logic_score = f"{100.0 * r['killed'] / logic:.1f}%" if logic else "-"
        real = logic - r["triaged_survivors"]
        real_score = f"{100.0 * r['killed'] / real:.1f}%" if real else "-"
        pending = counts.get("not checked", 0)
        cells = [
            module,
            f"{r['killed']} / {r['checked']}",
            score,
            logic_score,
            real_score,
            others or "-",
            pending,
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        summary[module] = {k: v for k, v in r.items() if k != "survivors"}
        if r["stale_triage"]:
            details.append(
                f"Triaged in mutation_triage.py but not surviving now ({module}): {r['stale_triage']}\n"
            )
        for s in r["survivors"]:
            tag = (
                " (wording only)"
                if s["message_only"]
                else f" (triaged: {s['triaged']})"
                if s["triaged"]
                else ""
            )
            details.append(f"### {s['mutant']}{tag}\n```diff\n{s['diff']}\n```\n")
    text = "\n".join(lines) + "\n\n## Survivors\n\n" + "\n".join(details)
    (work / "report.md").write_text(text, encoding="utf-8")
    (work / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help=f"modules under gym_ray/ (default: all: {list(MODULES)})")
    parser.add_argument("--budget-min", type=float, default=60.0, help="time budget for all modules, minutes")
    parser.add_argument("--work", default=str(ROOT / ".mutation"), help="work folders and the report")
    parser.add_argument("--report", action="store_true", help="print the report of earlier runs; run nothing")
    args = parser.parse_args(argv)
    modules = args.modules or list(MODULES)
    unknown = [m for m in modules if m not in MODULES]
    if unknown:
        print(f"unknown module(s) {unknown}; known: {list(MODULES)}", file=sys.stderr)
        return 2
    if shutil.which("mutmut") is None and not args.report:
        print('mutmut is not installed: pip install -e ".[mutation]"', file=sys.stderr)
        return 2
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if not args.report:
        deadline = time.monotonic() + args.budget_min * 60.0
        for i, module in enumerate(modules):
            left = deadline - time.monotonic()
            if left <= 0:
                print(f"budget spent: {module} and the rest resume on the next run", file=sys.stderr)
                break
            folder = _folder(work, module)
            _sync(folder)
            _configure(folder, module)
            share = left / (len(modules) - i)
            print(f"== {module}: up to {share / 60:.1f} min", file=sys.stderr, flush=True)
            started = time.monotonic()
            if _tests_changed(folder, module) and (survivors := _survivors(folder, module)):
                # new tests may kill old survivors: recollect which tests cover what, then retry those
                (folder / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
                print(f"   tests changed: checking {len(survivors)} survivors again", file=sys.stderr)
                _run(folder, share, survivors)
            finished = _run(folder, share - (time.monotonic() - started))
            if not finished and not (folder / "mutants" / "mutmut-stats.json").exists():
                # mutmut's first run in a fresh folder can fail to import the tests it has just copied
                # ("No module named 'tests'": a stale import cache); the second run finds them
                finished = _run(folder, share - (time.monotonic() - started))
            if not finished:
                print(f"   {module}: stopped (time slice over or mutmut failed; see its mutmut-run.log)")
    print(_report(work, modules))
    return 0


if __name__ == "__main__":
    sys.exit(main())
