#!/usr/bin/env python
"""Mutation testing of gym_ray's core with mutmut: which small bugs does the suite not notice?

Usage (from the repository root; ``pip install -e ".[test,mutation]"`` first)::

    python scripts/mutation.py --budget-min 1500       # every module below; figures into docs/mutation.md
    python scripts/mutation.py --budget-min 10 servers/redaction.py
    python scripts/mutation.py --estimate              # mutants per module and what a full run costs
    python scripts/mutation.py --map                   # each module's tests, from the coverage map
    python scripts/mutation.py --report                # report and docs table of what has run; run nothing

Why mutmut (3.x): it is maintained, and it forks each mutant's test run from a process that has already
imported the package and collected the tests, so a mutant costs the tests that cover it and nothing else.
On this shared 2-core machine importing gym_ray and starting pytest alone takes 8-17 s of wall time, which
made cosmic-ray (a fresh test process per mutant; tried first) ~17 s per mutant against ~1 s here. mutmut
also runs only the tests that executed the mutated function, and keeps its results on disk, so a rerun
checks only the mutants without a result (incremental; a changed function gets new mutants).

Which tests (no hand-kept list): the script snapshots the tracked files into ``<work>/tree/`` and runs the
suite there once under coverage with one context per test (pytest-cov's ``--cov-context=test``),
measuring only the modules below. A test belongs to a module's selection when it executed a line inside
one of the module's functions or methods (what mutmut mutates; import-time lines do not count), in its
setup, call or teardown. The map is cached in ``<work>/coverage-map.json`` under the content hash of
``gym_ray/``, ``tests/`` and ``pyproject.toml`` (and the module list): any edit there rebuilds it.
Left out of every selection: tests that start Ray (the ``ray_session`` fixture or the ``ray`` marker: a
Ray instance started in mutmut's process cannot be forked per mutant, and its workers run outside
mutmut's per-function bookkeeping), tests that failed in the map run (mutmut needs a green clean run;
they are listed), the slow tests (``GYM_RAY_SLOW_TESTS`` is unset, as in a developer's run), and the few
tests in ``DESELECT``, each with its reason. mutmut then narrows each mutant to the selected tests that
called its function, and a small pytest plugin runs the test files fastest first, so a killed mutant
(``-x``) usually stops at a fast test. The snapshot is taken once per invocation: edits made to the
checkout while the script runs reach neither the map nor any module.

How: each module gets its own work folder ``<work>/<module>/`` holding a copy of the snapshot (files are
copied only when their bytes changed, so results stay valid) and a ``pyproject.toml`` whose ``[tool.mutmut]``
names the module and its tests. mutmut mutates a copy in ``<work>/<module>/mutants/``, so the checkout you
work in is never touched. A changed selection makes mutmut check every mutant of the module again; changed
test files (same selection) make the script check the survivors again. The time budget is shared between the
modules still to run; a module whose slice runs out resumes next time.

Figures: every run (and ``--report``) rewrites the table between ``<!-- mutation:begin -->`` and
``<!-- mutation:end -->`` in docs/mutation.md (killed / checked per module, the date, commit, mutmut time
and the survivors' triage status against ``scripts/mutation_triage.py``), and writes ``<work>/report.md``
(every survivor with its diff, for triage) and ``summary.json``. No figure is copied by hand. Not part of
CI's default run.
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from mutation_triage import TRIAGED

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "mutation.md"
BEGIN, END = "<!-- mutation:begin -->", "<!-- mutation:end -->"

#: The core modules (under gym_ray/): those whose bugs lose, duplicate or leak data.
MODULES: tuple[str, ...] = (
    "record/ledger.py",
    "_json.py",
    "plan/resume.py",
    "plan/validation.py",
    "finalize/merge.py",
    "finalize/_merge_shard.py",
    "record/writer.py",
    "record/shard_files.py",
    "record/recording.py",
    "finalize/aggregate.py",
    "finalize/_aggregate_spool.py",
    "dispatch/engine.py",
    "dispatch/_completion.py",
    "dispatch/helper.py",
    "run/collect.py",
    "distributed/driver.py",
    # the stream's core: rows admitted into groups, staleness, filters, and the moment of delivery
    "streaming/delivery.py",
    "servers/redaction.py",
)

#: Tests left out of the selections although they cover the module ("*": every module), each with its
#: reason. An entry matches a test id, or every parametrized case of it. Keep this short: a test left out
#: is a test whose kills the figures do not count.
DESELECT: dict[str, dict[str, str]] = {
    "*": {
        # whole runs in subprocesses or on wall-clock timers: 6-56 s each, and they reach most modules
        # in-process (the ledger and file checks after the run), so every mutant of those functions would
        # pay them; faster in-process tests call every function they reach
        "tests/run/test_cli_run.py::test_sigterm_stops_like_ctrl_c_exit_143_and_the_rerun_completes": (
            "a `gym-ray run` CLI with its own Ray in a subprocess, stopped and run again (56 s)"
        ),
        "tests/run/test_cli_run.py::test_a_killed_driver_and_coordinator_actor_is_named_and_the_folder_stays_"
        "resumable": "a `gym-ray run` CLI with its own Ray in a subprocess, its actor killed (49 s)",
        "tests/run/test_readme_flow.py::test_the_readme_serve_then_run_commands_work_as_written": (
            "README's serve / run / status / aggregate commands as subprocesses (35 s)"
        ),
        "tests/chaos/test_repair_and_cleanup.py::test_sigkill_resume_cycles_leave_no_temp_folder_and_lose_"
        "nothing": "three collection subprocesses killed with SIGKILL and resumed (13 s)",
        "tests/observe/test_health_metrics.py::test_one_outage_gives_one_outage_three_infra_failures_and_up_"
        "again": "a real server outage waited out on the wall clock (11 s)",
        "tests/chaos/test_server_outage.py::test_a_server_down_past_the_timeout_stops_the_run_resumable": (
            "a real server outage past its timeout, on the wall clock (8 s)"
        ),
        "tests/chaos/test_server_outage.py::test_a_short_server_outage_mid_run_costs_no_failure_record": (
            "a real 3 s server outage mid-run, on the wall clock (6 s)"
        ),
        "tests/bench/test_bench_ceiling.py::test_latency_bench_with_wrk_reports_its_rate_over_the_ideal": (
            "a benchmark under wrk (7 s): it measures throughput, not the modules' results"
        ),
        "tests/dispatch/test_dispatch_close.py::test_200k_generator_rows_keep_live_tasks_bounded_without_"
        "http": "200k rows (15 s): the bound on live tasks is checked by the 2,560-row and generator tests",
        "tests/finalize/test_merge.py::test_merge_classifies_mutated_lines_like_the_jsonl_reader": (
            "400 merges (6 s) pinning the fast parser's verdicts, which the crafted and random merge tests "
            "check too"
        ),
        # spawn pools and memory bounds
        "tests/finalize/test_merge.py::test_process_pool_writes_the_same_bytes_and_counts_as_in_process": (
            "spawn pool: 15 s per mutant under mutmut (every pool process imports the mutated package); "
            "in-process sorting runs the same per-shard functions in every other merge test"
        ),
        "tests/finalize/test_merge.py::test_error_in_a_pool_process_surfaces_like_in_process": (
            "spawn pool (as above); the in-process half of the same error is pinned by the merge tests"
        ),
        "tests/finalize/test_aggregate_memory.py::test_whole_call_memory_does_not_grow_with_the_tasks": (
            "tracemalloc bound (7-13 s): it measures memory; the bytes it checks are pinned by faster tests"
        ),
        "tests/finalize/test_aggregate_memory.py::test_request_side_memory_does_not_grow_with_the_results": (
            "tracemalloc bound (as above)"
        ),
    },
    "dispatch/engine.py": {
        "tests/dispatch/test_health.py::test_retry_after_pauses_admission_and_429s_spend_the_infra_budget_"
        "not_attempts": (
            "a mutant that never ends the resend loop spins this test (Retry-After on a fake clock) into "
            "pytest's 120 s timeout; test_engine_contracts.py checks the resend count within 30 s"
        ),
    },
}

#: Where the coverage map looks for tests (every test there runs once under coverage).
MAP_PATHS: tuple[str, ...] = ("tests",)
#: Bumped when the map's format or its rules change (part of the cache key).
MAP_VERSION = 1
RAY_FIXTURE = "ray_session"

#: mutmut's exit code -> outcome (``mutmut.stats.status_by_exit_code``; unknown codes are "suspicious").
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped"}
STATUS |= {code: "timeout" for code in (24, -24, 36, 152, 255)}
STATUS |= {37: "caught by type check", -11: "segfault", -9: "segfault", 2: "interrupted"}


# -- the snapshot and the coverage map ---------------------------------------------------------------


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def _sync(src: Path, dest: Path, files: list[str]) -> None:
    """Copy ``files`` from ``src`` to ``dest``, each only when its bytes changed; drop stale modules, tests.

    A file under gym_ray/ or tests/ that is not in ``files`` any more (deleted or renamed) is removed from
    ``dest`` and from ``dest/mutants``, so no stale module or test can be imported or collected.
    """
    for rel in files:
        s, d = src / rel, dest / rel
        if not s.is_file() or (d.is_file() and d.read_bytes() == s.read_bytes()):
            continue
        d.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(s, d)
    keep = set(files)
    for top in ("gym_ray", "tests"):
        for path in (dest / top).rglob("*"):
            rel = path.relative_to(dest).as_posix()
            if path.is_file() and "__pycache__" not in path.parts and rel not in keep:
                path.unlink()
                (dest / "mutants" / rel).unlink(missing_ok=True)


def _snapshot(work: Path) -> dict[str, Any]:
    """Copy the tracked (and new, unignored) files to ``<work>/tree``; its content hash, commit and state."""
    files = [f for f in _git("ls-files", "--cached", "--others", "--exclude-standard").splitlines() if f]
    tree = work / "tree"
    _sync(ROOT, tree, files)
    digest = hashlib.sha256(json.dumps([MAP_VERSION, MODULES, MAP_PATHS, RAY_FIXTURE]).encode())
    for rel in sorted(files):
        if (rel.startswith(("gym_ray/", "tests/")) or rel == "pyproject.toml") and (tree / rel).is_file():
            digest.update(rel.encode() + b"\0" + hashlib.sha256((tree / rel).read_bytes()).digest())
    dirty = bool(_git("status", "--porcelain", "--", "gym_ray", "tests", "pyproject.toml").strip())
    return {
        "tree": tree,
        "files": files,
        "key": digest.hexdigest(),
        "commit": _git("rev-parse", "HEAD").strip(),
        "dirty": dirty,
    }


# Runs in the snapshot: the map paths once under coverage, one context per test; writes durations and ids.
_MAPPER = r"""
import json, sys, time
import pytest

out, rc_file, ray_fixture, paths = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
durations, failed, left_out = {}, set(), []


class Plugin:
    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        keep, drop = [], []
        for item in items:
            ray = ray_fixture in getattr(item, "fixturenames", ()) or item.get_closest_marker("ray")
            (drop if ray else keep).append(item)
        if drop:
            left_out.extend(item.nodeid for item in drop)
            config.hook.pytest_deselected(items=drop)
            items[:] = keep

    def pytest_runtest_logreport(self, report):
        durations[report.nodeid] = durations.get(report.nodeid, 0.0) + report.duration
        if report.failed:
            failed.add(report.nodeid)


start = time.monotonic()
code = pytest.main(
    # one token per option: a bare path among the arguments would move pytest's rootdir (and the test ids)
    ["--rootdir=.", "-p", "no:cacheprovider", "-q", "--cov", f"--cov-config={rc_file}", "--cov-context=test",
     "--cov-report=", *paths],
    plugins=[Plugin()],
)
with open(out, "w") as f:
    json.dump({"exit": int(code), "seconds": time.monotonic() - start, "durations": durations,
               "failed": sorted(failed), "left_out": sorted(left_out)}, f)
"""


def _functions(path: Path) -> dict[int, str]:
    """Line -> mutmut's name of the function whose body holds it (top-level functions and methods)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    owner: dict[int, str] = {}

    def claim(node: ast.FunctionDef | ast.AsyncFunctionDef, name: str) -> None:
        for line in range(node.body[0].lineno, (node.end_lineno or node.lineno) + 1):
            owner[line] = name

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            claim(node, f"x_{node.name}")
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    claim(sub, f"xǁ{node.name}ǁ{sub.name}")
    return owner


def _env(*pythonpath: Path) -> dict[str, str]:
    env = dict(os.environ)
    # the snapshot or the mutated copy (and the test-order plugin), never the editable install
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    env.pop("GYM_RAY_SLOW_TESTS", None)  # a developer's run: CI's slow tests stay skipped
    env.pop("COVERAGE_PROCESS_START", None)
    return env


def _build_map(work: Path, snap: dict[str, Any]) -> dict[str, Any]:
    from coverage import CoverageData

    tree: Path = snap["tree"]
    folder = work / "map"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rc = folder / "coveragerc"
    include = "\n    ".join(str(tree / "gym_ray" / m) for m in MODULES)
    rc.write_text(
        f"[run]\ndata_file = {folder / 'coverage.db'}\ninclude =\n    {include}\n", encoding="utf-8"
    )
    out = folder / "run.json"
    print(
        f"== coverage map: running {' '.join(MAP_PATHS)} once under coverage (log: {folder / 'run.log'})",
        file=sys.stderr,
        flush=True,
    )
    started = time.monotonic()
    with (folder / "run.log").open("wb") as log:
        subprocess.run(
            [sys.executable, "-c", _MAPPER, str(out), str(rc), RAY_FIXTURE, *MAP_PATHS],
            cwd=tree,
            env=_env(tree),
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
        )
    seconds = time.monotonic() - started
    if not out.exists():
        raise SystemExit(f"the coverage run failed before its end: see {folder / 'run.log'}")
    run = json.loads(out.read_text(encoding="utf-8"))
    failed = set(run["failed"])
    data = CoverageData(basename=str(folder / "coverage.db"))
    data.read()
    functions: dict[str, dict[str, list[str]]] = {}
    for module in MODULES:
        path = tree / "gym_ray" / module
        owner = _functions(path)
        by_function: dict[str, set[str]] = {}
        for line, contexts in data.contexts_by_lineno(str(path)).items():
            name = owner.get(line)
            if name is None:
                continue
            for context in contexts:
                test = context.rpartition("|")[0]  # "<node id>|setup", "|run" or "|teardown"
                if test and test not in failed:
                    by_function.setdefault(name, set()).add(test)
        functions[module] = {name: sorted(tests) for name, tests in sorted(by_function.items())}
    cmap = {
        "key": snap["key"],
        "commit": snap["commit"],
        "dirty": snap["dirty"],
        "built": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "seconds": round(seconds, 1),
        "paths": list(MAP_PATHS),
        "exit": run["exit"],
        "tests_run": sum(1 for t in run["durations"] if "::" in t),
        "left_out_ray": run["left_out"],
        "failed": run["failed"],
        "durations": {k: round(v, 4) for k, v in run["durations"].items()},
        "functions": functions,
    }
    (work / "coverage-map.json").write_text(json.dumps(cmap, indent=1, ensure_ascii=False), encoding="utf-8")
    print(
        f"   map built in {seconds / 60:.1f} min ({cmap['tests_run']} tests run, "
        f"{len(cmap['left_out_ray'])} that start Ray left out, {len(failed)} failed)",
        file=sys.stderr,
    )
    for test in run["failed"]:
        print(f"   failed in the map run, left out of every selection: {test}", file=sys.stderr)
    return cmap


def _coverage_map(work: Path, snap: dict[str, Any], *, build: bool = True) -> dict[str, Any] | None:
    """The cached map when it is of this snapshot's content, else a new one (None if ``build`` is off)."""
    path = work / "coverage-map.json"
    if path.exists():
        cmap: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        if cmap.get("key") == snap["key"] or not build:
            return cmap
    return _build_map(work, snap) if build else None


def _deselected(module: str, test: str) -> str | None:
    for scope in ("*", module):
        for entry, reason in DESELECT.get(scope, {}).items():
            if test == entry or test.startswith((entry + "[", entry + "::")):
                return reason
    return None


def _selection(cmap: dict[str, Any], module: str) -> list[str]:
    tests = {t for ts in cmap["functions"].get(module, {}).values() for t in ts}
    return sorted(t for t in tests if _deselected(module, t) is None)


# -- mutmut ------------------------------------------------------------------------------------------


def _folder(work: Path, module: str) -> Path:
    return work / module.replace("/", "__").removesuffix(".py")


#: pytest plugin in each work folder: the selected test files fastest first (by the median of their tests'
#: times in the map run), each file's tests in pytest's own order (fixture scopes stay grouped). mutmut runs a
#: mutant's tests with ``-x``, so a killed mutant stops at its first failing test: fast files first make
#: most kills cost milliseconds instead of the slowest test in the set.
_ORDER_PLUGIN = """\
import json
from pathlib import Path

import pytest

_RANK = json.loads(Path(__file__).with_name("file_rank.json").read_text(encoding="utf-8"))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: _RANK.get(item.nodeid.split("::")[0], len(_RANK)))
"""


def _configure(folder: Path, module: str, tests: list[str], durations: dict[str, float]) -> None:
    section = (
        "\n[tool.mutmut]\n"
        f'source_paths = ["gym_ray/{module}"]\n'
        'also_copy = ["gym_ray", "tests"]\n'
        f"pytest_add_cli_args_test_selection = {json.dumps(tests, ensure_ascii=False)}\n"
        'pytest_add_cli_args = ["-p", "no:cacheprovider", "-p", "mutation_order"]\n'
        # debug: pytest's own output in mutmut-run.log (without it a failing clean run says only "failed")
        "debug = true\n"
    )
    text = (folder / "pyproject.toml").read_text(encoding="utf-8") + section
    (folder / "pyproject.toml").write_text(text, encoding="utf-8")
    by_file: dict[str, list[float]] = {}
    for test in tests:
        by_file.setdefault(test.split("::")[0], []).append(durations.get(test, 0.0))
    median = {path: sorted(times)[len(times) // 2] for path, times in by_file.items()}
    rank = {path: i for i, path in enumerate(sorted(median, key=lambda path: (median[path], path)))}
    plugin = folder / "plugin"
    plugin.mkdir(exist_ok=True)
    (plugin / "mutation_order.py").write_text(_ORDER_PLUGIN, encoding="utf-8")
    (plugin / "file_rank.json").write_text(json.dumps(rank, indent=0), encoding="utf-8")


def _digest(items: list[str]) -> str:
    return hashlib.sha256("\n".join(items).encode()).hexdigest()


def _tests_changed(folder: Path, tests: list[str]) -> bool:
    """True (once) when the selected test files or a conftest changed since the last run: survivors again."""
    digest = hashlib.sha256()
    paths = sorted(
        {t.split("::")[0] for t in tests}
        | {p.relative_to(folder).as_posix() for p in (folder / "tests").rglob("conftest.py")}
    )
    for path in paths:
        digest.update(path.encode() + b"\0" + (folder / path).read_bytes())
    stamp = folder / "tests.sha256"
    changed = stamp.exists() and stamp.read_text() != digest.hexdigest()
    stamp.write_text(digest.hexdigest())
    return changed


def _meta(folder: Path, module: str) -> dict[str, int | None]:
    meta = folder / "mutants" / "gym_ray" / (module + ".meta")
    if not meta.exists():
        return {}
    codes: dict[str, int | None] = json.loads(meta.read_text(encoding="utf-8"))["exit_code_by_key"]
    return codes


#: ``mutmut`` from this interpreter (its console script need not be on PATH)
_MUTMUT = "import sys; from mutmut.__main__ import cli; sys.argv[0] = 'mutmut'; sys.exit(cli())"


def _run(folder: Path, seconds: float, names: list[str] | None = None) -> bool:
    """``mutmut run`` (of ``names`` only, when given) for at most ``seconds``; True when it finished."""
    with (folder / "mutmut-run.log").open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", _MUTMUT, "run", "--max-children", "1", *(names or [])],
            cwd=folder,
            env=_env(folder / "mutants", folder / "plugin"),
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


def _log_run(
    folder: Path, snap: dict[str, Any], cmap: dict[str, Any], tests: list[str], seconds: float, finished: bool
) -> None:
    path = folder / "runs.json"
    runs = json.loads(path.read_text(encoding="utf-8")) if path.exists() else []
    runs.append(
        {
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "commit": snap["commit"],
            "dirty": snap["dirty"],
            "tree": snap["key"],
            "map": cmap["key"],  # differs from "tree" only with --stale-map
            "selection": _digest(tests),
            "tests": len(tests),
            "seconds": round(seconds, 1),
            "finished": finished,
        }
    )
    path.write_text(json.dumps(runs, indent=1), encoding="utf-8")


def _runs(folder: Path) -> tuple[dict[str, Any] | None, float]:
    """The module's last run and the mutmut seconds spent on its current results (same selection)."""
    path = folder / "runs.json"
    runs: list[dict[str, Any]] = json.loads(path.read_text(encoding="utf-8")) if path.exists() else []
    if not runs:
        return None, 0.0
    last = runs[-1]
    seconds = 0.0
    for run in reversed(runs):
        if run["selection"] != last["selection"]:
            break
        seconds += run["seconds"]
    return last, seconds


# -- results, report and the docs table -------------------------------------------------------------

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
    codes = _meta(folder, module)
    if not codes:
        return {"checked": 0, "total": 0}
    counts: dict[str, int] = {}
    for code in codes.values():
        status = "not checked" if code is None else STATUS.get(code, "suspicious")
        counts[status] = counts.get(status, 0) + 1
    names = sorted(key for key, code in codes.items() if code == 0)
    # every survivor's diff from one process (``mutmut show`` per mutant costs seconds each here)
    shown = subprocess.run(
        [sys.executable, "-c", _DIFFS, *names],
        cwd=folder,
        env=_env(folder / "mutants"),
        capture_output=True,
        text=True,
    )
    diffs: dict[str, str] = json.loads(shown.stdout) if shown.returncode == 0 else {}
    prefix = "gym_ray." + module.removesuffix(".py").replace("/", ".") + "."
    triaged = TRIAGED.get(module, {})
    survivors: list[dict[str, Any]] = []
    for key in names:
        diff = diffs.get(key, "(diff unavailable: run `mutmut show` in the module's work folder)").strip()
        reason = triaged.get(key.removeprefix(prefix))
        survivors.append(
            {"mutant": key, "diff": diff, "message_only": _message_only(diff), "triaged": reason}
        )
    killed, survived = counts.get("killed", 0), counts.get("survived", 0)
    wording = sum(1 for s in survivors if s["message_only"])
    hand = sum(1 for s in survivors if s["triaged"] and not s["message_only"])
    surviving = {key.removeprefix(prefix) for key in names}
    return {
        "counts": counts,
        "killed": killed,
        "checked": killed + survived,
        "message_only_survivors": wording,
        "triaged_survivors": hand,
        "untriaged": [
            s["mutant"].removeprefix(prefix) for s in survivors if not s["message_only"] and not s["triaged"]
        ],
        # killed now, or renumbered: check them again (only once every mutant has a result)
        "stale_triage": [] if counts.get("not checked") else sorted(set(triaged) - surviving),
        "total": len(codes),
        "survivors": survivors,
    }


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def _row(module: str, r: dict[str, Any], last: dict[str, Any] | None, seconds: float) -> list[str]:
    if not r["total"] or last is None:
        return [f"`{module}`", str(r["total"] or "-"), "not run", *[""] * 8]
    counts = r["counts"]
    others = ", ".join(
        f"{k} {v}" for k, v in sorted(counts.items()) if k not in ("killed", "survived", "not checked")
    )
    logic = r["checked"] - r["message_only_survivors"]
    real = logic - r["triaged_survivors"]
    survivors = f"{r['message_only_survivors']} / {r['triaged_survivors']} / {len(r['untriaged'])}"
    run = "-"
    if last:
        run = f"{last['date'][:10]} `{last['commit'][:9]}`" + (" + edits" if last["dirty"] else "")
        if last.get("map", last["tree"]) != last["tree"]:
            run += ", tests from an older map"
    return [
        f"`{module}`",
        str(r["total"]),
        f"{r['killed']} / {r['checked']}",
        _pct(r["killed"], r["checked"]),
        _pct(r["killed"], logic),
        _pct(r["killed"], real),
        survivors,
        others or "-",
        str(counts.get("not checked", 0)),
        f"{last['tests'] if last else '-'} / {seconds / 60:.1f} min",
        run,
    ]


def _docs_table(work: Path, results: dict[str, dict[str, Any]], cmap: dict[str, Any] | None) -> str:
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        BEGIN,
        "",
        f"Generated by `python scripts/mutation.py` on {now}; the next run rewrites everything between the "
        "two markers, so edit nothing here by hand.",
        "",
    ]
    if cmap:
        state = "with uncommitted edits to gym_ray/, tests/ or pyproject.toml" if cmap["dirty"] else "clean"
        lines += [
            f"Test selection: the coverage map of tree `{cmap['key'][:12]}` (commit `{cmap['commit'][:9]}`, "
            f"{state}), built {cmap['built'][:10]} in {cmap['seconds'] / 60:.1f} min over "
            f"`{' '.join(cmap['paths'])}`: {cmap['tests_run']} tests ran, {len(cmap['left_out_ray'])} that "
            f"start Ray were left out, {len(cmap['failed'])} failed and were left out.",
            "",
        ]
    total = 0.0
    table = [
        "| module | mutants | killed / checked | score | without wording-only | without wording and "
        "triaged | survivors: wording-only / triaged / untriaged | other outcomes | not checked | "
        "tests / mutmut time | last run |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    untriaged, stale = [], []
    for module, r in results.items():
        last, seconds = _runs(_folder(work, module))
        total += seconds
        table.append("| " + " | ".join(_row(module, r, last, seconds)) + " |")
        if r.get("untriaged"):
            untriaged.append(f"- `{module}`: " + ", ".join(f"`{n}`" for n in r["untriaged"]))
        if r.get("stale_triage"):
            stale.append(f"- `{module}`: " + ", ".join(f"`{n}`" for n in r["stale_triage"]))
    complete = sum(1 for r in results.values() if r["total"] and not r["counts"].get("not checked"))
    lines += [
        f"Modules with every mutant checked: {complete} of {len(results)}. "
        f"mutmut time of these figures: {total / 60:.0f} min in all (one mutmut process at a time, on "
        f"this machine: {os.cpu_count()} cores, shared). Score = killed / (killed + survived); "
        '"without wording-only" leaves out survivors that change only the words of a message; '
        '"without wording and triaged" also leaves out the survivors triaged by hand in '
        "`scripts/mutation_triage.py`.",
        "",
        *table,
        "",
        "Untriaged survivors (to kill with a test, or to triage in `scripts/mutation_triage.py`; their "
        "diffs are in `.mutation/report.md`):"
        if untriaged
        else "Untriaged survivors: none.",
        *untriaged,
        "",
    ]
    if stale:
        lines += [
            "Triage entries that no longer survive (killed now, or renumbered: check them again):",
            *stale,
            "",
        ]
    left_out = []
    for scope, entries in DESELECT.items():
        for test, reason in entries.items():
            where = "every module" if scope == "*" else f"`{scope}`"
            known = cmap is None or any(
                t == test or t.startswith((test + "[", test + "::")) for t in cmap["durations"]
            )
            gone = "" if known else " **Matches no test now: drop the entry.**"
            left_out.append(f"- `{test}` ({where}): {reason}.{gone}")
    lines += ["Tests left out by hand (`DESELECT` in the script):", *left_out, "", END]
    return "\n".join(_wrap(line) for line in lines)


def _wrap(line: str) -> str:
    """A prose line or list item of the generated section, wrapped like the rest of docs/mutation.md."""
    if not line or line.startswith(("|", "<!--")):
        return line
    item = line.startswith("- ")
    return textwrap.fill(
        line[2:] if item else line,
        110,
        initial_indent="- " if item else "",
        subsequent_indent="  " if item else "",
        break_long_words=False,
        break_on_hyphens=False,
    )


def _write_docs(table: str) -> None:
    text = DOCS.read_text(encoding="utf-8")
    start, stop = text.find(BEGIN), text.find(END)
    if start < 0 or stop < start:
        text = text.rstrip("\n") + "\n\n## Figures\n\n" + table + "\n"
    else:
        text = text[:start] + table + text[stop + len(END) :]
    DOCS.write_text(text, encoding="utf-8")


def _report(work: Path, modules: list[str], cmap: dict[str, Any] | None, docs: bool) -> str:
    results = {module: _results(_folder(work, module), module) for module in MODULES}
    lines = [
        "# Mutation report (mutmut)",
        "",
        "Score = killed / (killed + survived). The second score leaves out survivors that change only the",
        "wording of a string literal (error-message text: tests pin the parts a user acts on, the file,",
        "line, key or row, with `match=`, not every word). The third also leaves out the survivors triaged",
        "by hand in `scripts/mutation_triage.py` (equivalent, or covered by a test the run deselects).",
        "",
        "| module | mutants | killed / checked | score | without wording-only | without wording and triaged "
        "| survivors: wording-only / triaged / untriaged | other outcomes | not checked "
        "| tests / mutmut time | last run |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    details: list[str] = []
    summary: dict[str, Any] = {}
    for module in modules:
        r = results[module]
        last, seconds = _runs(_folder(work, module))
        lines.append("| " + " | ".join(_row(module, r, last, seconds)) + " |")
        if not r["total"]:
            continue
        summary[module] = {k: v for k, v in r.items() if k != "survivors"} | {"mutmut_seconds": seconds}
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
    if docs:
        _write_docs(_docs_table(work, results, cmap))
        print(f"figures written to {DOCS.relative_to(ROOT)}", file=sys.stderr)
    return text


# -- the estimate ------------------------------------------------------------------------------------

_GENERATE = """
import os
from mutmut.__main__ import copy_also_copy_files, copy_src_dir, create_mutants, setup_source_paths
from mutmut.mutation.trampoline import set_mutant_under_test
set_mutant_under_test("mutant_generation")
os.makedirs("mutants", exist_ok=True)
copy_src_dir(); copy_also_copy_files(); setup_source_paths(); create_mutants(1)
"""


def _prepare(
    work: Path, snap: dict[str, Any], module: str, tests: list[str], durations: dict[str, float]
) -> Path:
    folder = _folder(work, module)
    _sync(snap["tree"], folder, snap["files"])
    _configure(folder, module, tests, durations)
    return folder


def _estimate(
    work: Path, snap: dict[str, Any], cmap: dict[str, Any], modules: list[str], surviving: float
) -> None:
    """Mutants per module (generated, not run) times the cost of one, from the map's test durations.

    Model: a module runs its whole selection twice (mutmut's stats run and its clean run), then each mutant
    costs ``PER_MUTANT`` (fork, pytest's session in the child) plus its tests: a survivor runs every selected
    test that calls its function, a killed mutant stops at its first failure (``-x``), taken as the fastest
    quarter of those tests (fast files run first). ``surviving`` is the share of survivors. The model is
    then scaled by what the modules that ran to the end really took against what it predicts for them with
    their own share of survivors (the map's durations are measured under coverage, on a loaded machine).
    "upper" lets every mutant run all its tests.
    """
    durations: dict[str, float] = cmap["durations"]
    rows = []
    actual = predicted = 0.0
    for module in modules:
        tests = _selection(cmap, module)
        folder = _prepare(work, snap, module, tests, durations)
        made = subprocess.run(
            [sys.executable, "-c", _GENERATE], cwd=folder, env=_env(folder / "mutants"), capture_output=True
        )
        if made.returncode != 0:
            print(f"{module}: mutant generation failed:\n{made.stdout.decode()[-2000:]}", file=sys.stderr)
            continue
        codes = _meta(folder, module)
        prefix = "gym_ray." + module.removesuffix(".py").replace("/", ".") + "."
        per_function: dict[str, int] = {}
        for key in codes:
            name = key.removeprefix(prefix).rsplit("__mutmut_", 1)[0]
            per_function[name] = per_function.get(name, 0) + 1
        functions = cmap["functions"].get(module, {})
        all_tests = kill_tests = 0.0
        untested = 0
        for name, count in per_function.items():
            own = sorted(
                durations.get(t, 0.0) for t in functions.get(name, []) if _deselected(module, t) is None
            )
            if not own:
                untested += count
            all_tests += count * sum(own)
            kill_tests += count * sum(own[: (len(own) + 3) // 4])
        base = 2 * sum(durations.get(t, 0.0) for t in tests) + (len(codes) - untested) * PER_MUTANT
        last, seconds = _runs(folder)
        killed = sum(1 for c in codes.values() if c is not None and STATUS.get(c) == "killed")
        survived = sum(1 for c in codes.values() if c == 0)
        done = bool(codes) and all(code is not None for code in codes.values())
        if last and done and last["selection"] == _digest(tests) and killed + survived:
            share = survived / (killed + survived)
            actual += seconds
            predicted += base + share * all_tests + (1 - share) * kill_tests
        likely = base + surviving * all_tests + (1 - surviving) * kill_tests
        rows.append(
            (module, len(codes), untested, len(tests), likely, base + all_tests, seconds if done else None)
        )
    scale = actual / predicted if predicted else 1.0
    print(
        f"\nsurvivors taken as {surviving:.0%}; model scaled by {scale:.2f} "
        f"({'measured on the modules that ran to the end' if predicted else 'no module has run to the end'})"
    )
    print(
        f"{'module':28} {'mutants':>7} {'no test':>7} {'tests':>6} "
        f"{'likely min':>10} {'upper min':>9} {'ran min':>7}"
    )
    likely_all = upper_all = 0.0
    for module, n, untested, ntests, likely, upper, ran in rows:
        likely, upper = scale * likely / 60, scale * upper / 60
        likely_all, upper_all = likely_all + likely, upper_all + upper
        ran_text = f"{ran / 60:.1f}" if ran is not None else "-"
        print(f"{module:28} {n:7d} {untested:7d} {ntests:6d} {likely:10.1f} {upper:9.1f} {ran_text:>7}")
    total = f"{sum(r[1] for r in rows):7d}"
    print(f"{'all':28} {total} {'':7} {'':6} {likely_all:10.1f} {upper_all:9.1f}")
    print(f"all: {likely_all / 60:.1f} h likely, {upper_all / 60:.1f} h at most", file=sys.stderr)


#: The model's fixed cost of one mutant (s): fork, pytest's session in the child, its report.
PER_MUTANT = 1.0


# -- main --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help=f"modules under gym_ray/ (default: all: {list(MODULES)})")
    parser.add_argument("--budget-min", type=float, default=60.0, help="mutmut time for all modules, minutes")
    parser.add_argument("--work", default=str(ROOT / ".mutation"), help="work folders, map and report")
    parser.add_argument("--report", action="store_true", help="report and docs table of earlier runs only")
    parser.add_argument("--map", action="store_true", help="(re)build the map if stale; show tests")
    parser.add_argument("--estimate", action="store_true", help="count mutants and estimate a full run")
    parser.add_argument(
        "--survivors",
        type=float,
        default=0.10,
        help="share of survivors the estimate assumes (default 0.10: earlier rounds killed 85-99%%)",
    )
    parser.add_argument("--no-docs", action="store_true", help="leave docs/mutation.md alone")
    parser.add_argument(
        "--stale-map",
        action="store_true",
        help="while developing: keep the cached coverage map although the tree changed (the table says so)",
    )
    args = parser.parse_args(argv)
    modules = args.modules or list(MODULES)
    unknown = [m for m in modules if m not in MODULES]
    if unknown:
        print(f"unknown module(s) {unknown}; known: {list(MODULES)}", file=sys.stderr)
        return 2
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if args.report:
        cached = work / "coverage-map.json"
        cmap = json.loads(cached.read_text(encoding="utf-8")) if cached.exists() else None
        print(_report(work, modules, cmap, docs=not args.no_docs))
        return 0
    needed = ("mutmut", "coverage", "pytest_cov")
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        print(f'{missing} not installed: pip install -e ".[test,mutation]"', file=sys.stderr)
        return 2
    snap = _snapshot(work)
    cmap = _coverage_map(work, snap, build=not args.stale_map) or _build_map(work, snap)
    if args.map:
        for module in modules:
            tests = _selection(cmap, module)
            print(f"{module}: {len(tests)} tests, {sum(cmap['durations'].get(t, 0) for t in tests):.1f} s")
            for test in tests:
                print(f"    {test}")
        return 0
    if args.estimate:
        _estimate(work, snap, cmap, modules, args.survivors)
        return 0
    deadline = time.monotonic() + args.budget_min * 60.0
    for i, module in enumerate(modules):
        left = deadline - time.monotonic()
        if left <= 0:
            print(f"budget spent: {module} and the rest resume on the next run", file=sys.stderr)
            break
        tests = _selection(cmap, module)
        if not tests:
            print(f"== {module}: no test executes its functions; skipped", file=sys.stderr)
            continue
        folder = _prepare(work, snap, module, tests, cmap["durations"])
        share = left / (len(modules) - i)
        print(f"== {module}: {len(tests)} tests, up to {share / 60:.1f} min", file=sys.stderr, flush=True)
        started = time.monotonic()
        survivors = sorted(key for key, code in _meta(folder, module).items() if code == 0)
        if _tests_changed(folder, tests) and survivors:
            # new tests may kill old survivors: recollect which tests cover what, then retry those
            (folder / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
            print(f"   tests changed: checking {len(survivors)} survivors again", file=sys.stderr)
            _run(folder, share, survivors)
        finished = _run(folder, share - (time.monotonic() - started))
        if not finished and not (folder / "mutants" / "mutmut-stats.json").exists():
            # mutmut's first run in a fresh folder can fail to import the tests it has just copied
            # ("No module named 'tests'": a stale import cache); the second run finds them
            finished = _run(folder, share - (time.monotonic() - started))
        _log_run(folder, snap, cmap, tests, time.monotonic() - started, finished)
        if not finished:
            print(f"   {module}: stopped (time slice over or mutmut failed; see its mutmut-run.log)")
    print(_report(work, modules, cmap, docs=not args.no_docs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
