#!/usr/bin/env python
"""Mutation testing of gym_ray's core with cosmic-ray: which small bugs does the suite not notice?

Usage (from the repository root; ``pip install -e ".[mutation]"`` first)::

    python scripts/mutation.py                        # every module below, 60 minutes in all
    python scripts/mutation.py --budget-min 20 record/ledger.py plan/resume.py
    python scripts/mutation.py --report               # only print the report of what has run so far

Why cosmic-ray: it is maintained, mutates one copy of the code at a time and runs an arbitrary test
command per module (so each module gets only the tests that cover it), keeps every session in a SQLite
file (a rerun executes only the mutants still pending: incremental), and needs no import hooks (mutmut 3
runs its own trampolines in the test process, which do not reach Ray workers or spawned processes).

How: the tracked files are copied to ``<work>/src`` (cosmic-ray edits the module in place, so the checkout
you work in is never touched, even when this script is killed), and each module gets a session
``<work>/<module>.sqlite``. A session is created again when the module or its tests change (their sha256
is kept beside it), else resumed. The time budget is shared between the modules still pending; a module
whose slice runs out is resumed by the next invocation. The report (``<work>/report.md``, also printed)
gives killed / total per module and every survivor with its diff, for triage. Not part of CI.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: module (under gym_ray/) -> the tests that cover it (per-module selection keeps each mutant run short).
MODULES: dict[str, tuple[str, ...]] = {
    "record/ledger.py": ("tests/record/test_ledger.py", "tests/record/test_contracts.py"),
    "plan/resume.py": ("tests/plan/test_resume.py",),
    "record/merge.py": ("tests/record/test_merge.py",),
    "record/writer.py": ("tests/record/test_records.py", "tests/record/test_contracts.py"),
    "record/shard_files.py": ("tests/record/test_records.py", "tests/chaos/test_shard_lock.py"),
    "record/recording.py": ("tests/dispatch/test_helper_record.py",),
    "record/aggregate.py": ("tests/record/test_aggregate.py", "tests/record/test_contracts.py"),
    "record/_aggregate_spool.py": ("tests/record/test_aggregate.py", "tests/record/test_contracts.py"),
    "plan/validation.py": ("tests/plan/test_preprocess_validation.py", "tests/dispatch/test_contracts.py"),
    "dispatch/engine.py": ("tests/dispatch/test_dispatch.py", "tests/dispatch/test_contracts.py"),
    "dispatch/_completion.py": ("tests/dispatch/test_dispatch.py", "tests/dispatch/test_dispatch_close.py"),
    "distributed/driver.py": ("tests/distributed/test_distributed_driver.py",),
}
PYTEST = "python -m pytest -x -q -p no:cacheprovider -p no:randomly"


def _fingerprint(module: str, tests: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for rel in (f"gym_ray/{module}", *tests):
        digest.update(rel.encode() + b"\0" + (ROOT / rel).read_bytes())
    return digest.hexdigest()


def _copy_tree(src: Path) -> None:
    """The tracked files (and the new ones not yet committed) copied to ``src``, fresh each run."""
    if src.exists():
        shutil.rmtree(src)
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    for rel in listed:
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)


def _session(work: Path, module: str) -> Path:
    return work / (module.replace("/", "__").removesuffix(".py") + ".sqlite")


def _config(work: Path, module: str, tests: tuple[str, ...], timeout_s: float) -> Path:
    path = _session(work, module).with_suffix(".toml")
    path.write_text(
        "[cosmic-ray]\n"
        f'module-path = "gym_ray/{module}"\n'
        f"timeout = {timeout_s}\n"
        "excluded-modules = []\n"
        f'test-command = "{PYTEST} {" ".join(tests)}"\n'
        "\n[cosmic-ray.distributor]\n"
        'name = "local"\n',
        encoding="utf-8",
    )
    return path


def _env(src: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(src)
    env.setdefault("RAY_DEDUP_LOGS", "0")
    return env


def _prepare(work: Path, src: Path, module: str, timeout_s: float) -> tuple[Path, Path]:
    tests = MODULES[module]
    session = _session(work, module)
    config = _config(work, module, tests, timeout_s)
    stamp = session.with_suffix(".sha256")
    fingerprint = _fingerprint(module, tests)
    if not session.exists() or not stamp.exists() or stamp.read_text() != fingerprint:
        session.unlink(missing_ok=True)
        # baseline: the tests must pass on the unmutated copy, else every mutant would count as killed
        baseline = subprocess.run(f"{PYTEST} {' '.join(tests)}", shell=True, cwd=src, env=_env(src))
        if baseline.returncode != 0:
            raise SystemExit(f"{module}: its tests fail without any mutation; fix them first")
        subprocess.run(["cosmic-ray", "init", str(config), str(session)], cwd=src, env=_env(src), check=True)
        # lines marked `# pragma: no mutate` (justified equivalent mutants) are skipped
        subprocess.run(["cr-filter-pragma", str(session)], cwd=src, env=_env(src), check=True)
        stamp.write_text(fingerprint)
    return config, session


def _exec(src: Path, config: Path, session: Path, seconds: float) -> bool:
    """Run pending mutants for at most ``seconds``; True when the session finished."""
    proc = subprocess.Popen(
        ["cosmic-ray", "exec", str(config), str(session)], cwd=src, env=_env(src), start_new_session=True
    )
    try:
        proc.wait(timeout=max(seconds, 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 15)
        proc.wait()
        return False
    finally:
        # an interrupted mutant leaves its module mutated in the copy: restore it from the checkout
        module_path = _module_of(config)
        shutil.copy2(ROOT / module_path, src / module_path)
    return proc.returncode == 0


def _module_of(config: Path) -> str:
    for line in config.read_text(encoding="utf-8").splitlines():
        if line.startswith("module-path"):
            return line.split("=", 1)[1].strip().strip('"')
    raise SystemExit(f"{config}: no module-path")


def _results(session: Path) -> dict[str, object]:
    from cosmic_ray.work_db import WorkDB, use_db

    with use_db(str(session), WorkDB.Mode.open) as db:
        done = list(db.completed_work_items)
        pending = sum(1 for _ in db.pending_work_items)
    killed = survived = incompetent = skipped = 0
    survivors = []
    for item, result in done:
        outcome = str(result.test_outcome.value) if result.test_outcome else None
        if result.worker_outcome.value == "skipped":
            skipped += 1
        elif outcome == "killed":
            killed += 1
        elif outcome == "survived":
            survived += 1
            mutation = item.mutations[0]
            survivors.append(
                {
                    "line": mutation.start_pos[0],
                    "operator": mutation.operator_name,
                    "occurrence": mutation.occurrence,
                    "diff": result.diff or "",
                }
            )
        else:
            incompetent += 1
    return {
        "killed": killed,
        "survived": survived,
        "incompetent": incompetent,
        "skipped": skipped,
        "pending": pending,
        "survivors": sorted(survivors, key=lambda s: (s["line"], s["operator"])),  # type: ignore[arg-type,return-value]
    }


def _report(work: Path, modules: list[str]) -> str:
    lines = [
        "# Mutation report (cosmic-ray)",
        "",
        "| module | killed / run | score | survived | pending | skipped (pragma) |",
        "|---|---|---|---|---|---|",
    ]
    details = []
    summary = {}
    for module in modules:
        session = _session(work, module)
        if not session.exists():
            lines.append(f"| {module} | not started | | | | |")
            continue
        r = _results(session)
        run = int(r["killed"]) + int(r["survived"])  # type: ignore[call-overload]
        score = f"{100.0 * int(r['killed']) / run:.1f}%" if run else "-"  # type: ignore[call-overload]
        cells = [module, f"{r['killed']} / {run}", score, r["survived"], r["pending"], r["skipped"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        summary[module] = {k: v for k, v in r.items() if k != "survivors"}
        for s in r["survivors"]:  # type: ignore[attr-defined]
            head = f"### {module}:{s['line']} {s['operator']} #{s['occurrence']}"
            details.append(f"{head}\n```diff\n{s['diff']}```\n")
    text = "\n".join(lines) + "\n\n## Survivors\n\n" + "\n".join(details)
    (work / "report.md").write_text(text, encoding="utf-8")
    (work / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help=f"modules under gym_ray/ (default: all: {list(MODULES)})")
    parser.add_argument("--budget-min", type=float, default=60.0, help="time budget for all modules, minutes")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="one mutant's test run, seconds")
    parser.add_argument("--work", default=str(ROOT / ".mutation"), help="sessions, copy and report folder")
    parser.add_argument("--report", action="store_true", help="print the report of the sessions; run nothing")
    args = parser.parse_args(argv)
    modules = args.modules or list(MODULES)
    unknown = [m for m in modules if m not in MODULES]
    if unknown:
        print(f"unknown module(s) {unknown}; known: {list(MODULES)}", file=sys.stderr)
        return 2
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if not args.report:
        src = work / "src"
        _copy_tree(src)
        deadline = time.monotonic() + args.budget_min * 60.0
        for i, module in enumerate(modules):
            left = deadline - time.monotonic()
            if left <= 0:
                print(f"budget spent; {module} and later modules resume on the next run", file=sys.stderr)
                break
            config, session = _prepare(work, src, module, args.timeout_s)
            share = left / (len(modules) - i)
            print(f"== {module}: up to {share / 60:.1f} min", file=sys.stderr, flush=True)
            finished = _exec(src, config, session, share)
            if not finished:
                print(f"   {module}: time slice over, pending mutants resume next run", file=sys.stderr)
    print(_report(work, modules))
    return 0


if __name__ == "__main__":
    sys.exit(main())
