"""``gym-ray bench chaos``: the faults of issue 15 against real reference servers, with their figures.

Each scenario runs ``gym-ray run --local`` as child processes (so a run can be killed with SIGKILL) against
the package's reference servers, served by this process on 127.0.0.1 (so a server can be stopped and
restarted on the same port), and checks the run folder with the ledger (:func:`gym_ray.check_run`):

- ``outage``: the environment server is stopped once a quarter of the rows were sent and restarted
  ``outage_s`` later (20 s by default); the run must exit 0 with no failure record.
- ``outage-timeout``: the server stays down past ``server_outage_timeout_s`` (2 s here): the run must exit
  4 (``ServerOutageError``); the server comes back and a rerun on the folder exits 0.
- ``busy-folder``: a second run on a folder in use (the first one held mid-way by stopping its server) must
  exit 2 (``RunLockError``) and no ``/run`` may be executed twice.
- ``secret``: seeded secrets in the served config must appear in no reply of the head server (without its
  token), no file of the run folder and no line the run printed.
- ``quarantine``: garbage lines written into the middle of a finished shard are moved to the quarantine
  file by a rerun, which runs their rollouts again.
- ``kill-resume``: three SIGKILLs mid-run, then a run to the end: no ``.aggregate-*`` / ``.staging-*`` /
  ``.merge-*`` left, ledger at 0.

Figures per scenario: exit statuses, ledger (lost, missing, duplicates, corrupt lines), wasted requests
(``/run`` requests beyond one per planned rollout), failure records, time to recover (from the fault's end
to the next ``/run``, or to the rerun's end), pass/fail. The helpers are public so that ``tests/chaos``
uses the same scenario code.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gym_ray.errors import UsageError
from gym_ray.record.ledger import check_run
from gym_ray.servers import calc_config, calc_rows, serve_config
from gym_ray.servers.launch import Deployment

__all__ = [
    "CHAOS_SCENARIOS",
    "ScenarioFigures",
    "failure_records",
    "format_table",
    "run_chaos_bench",
    "temp_leftovers",
]

#: Scenario names, in the order they run.
CHAOS_SCENARIOS = ("outage", "outage-timeout", "busy-folder", "secret", "quarantine", "kill-resume")
#: Seconds a child run may take before the scenario fails.
CHILD_TIMEOUT_S = 600.0
#: Prefixes of the temp folders a killed run may leave.
TEMP_PREFIXES = (".staging", ".aggregate", ".merge", ".control")
SEEDED_SECRETS = ("sk-SEEDED-api-key-7f3a9", "SEEDED-password-41c2", "SEEDED-token-9d0e")


@dataclass
class ScenarioFigures:
    """What one scenario measured (``passed`` says whether every expectation held)."""

    scenario: str
    exit_statuses: list[int] = field(default_factory=list)
    lost: int = 0
    missing: int = 0
    duplicates: int = 0
    corrupt: int = 0
    wasted_requests: int = 0
    failure_records: int = 0
    recover_s: float | None = None
    passed: bool = False
    note: str = ""


def failure_records(run_dir: str | os.PathLike[str]) -> int:
    """Failure lines in the shards' failures files of ``run_dir``."""
    return sum(len(p.read_bytes().splitlines()) for p in Path(run_dir).glob("rollouts-*_failures.jsonl"))


def temp_leftovers(run_dir: str | os.PathLike[str]) -> list[str]:
    """Names of the temp folders and files a killed run may leave in ``run_dir`` (``.staging-*``, ...)."""
    return sorted(p.name for p in Path(run_dir).iterdir() if p.name.startswith(TEMP_PREFIXES))


async def until(predicate: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    """Wait until ``predicate()`` holds, checking every 20 ms.

    Raises:
        TimeoutError: It did not hold within ``timeout_s``; the message names ``what``.
    """
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(0.02)


class _Lab:
    """One scenario's folder: the served config as YAML, the input file, child runs."""

    def __init__(
        self, root: Path, dep: Deployment, rows: int, *, config: dict[str, Any] | None = None
    ) -> None:
        self.root = root
        self.dep = dep
        self.rows = rows
        self.out = root / "run"
        self.config = root / "run.yaml"
        self.config.write_text(json.dumps(dep.config if config is None else config))  # JSON is YAML
        self.input = root / "in.jsonl"
        self.input.write_text("".join(json.dumps(r) + "\n" for r in calc_rows(rows)))
        self.printed: list[str] = []

    async def start(self, *settings: str) -> asyncio.subprocess.Process:
        """Start ``gym-ray run --local`` on this folder (``settings``: ``+key=value`` overrides)."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gym_ray.cli",
            "run",
            str(self.config),
            f"+input_jsonl_fpath={self.input}",
            f"+output_dir={self.out}",
            *settings,
            "--local",
            "--progress",
            "off",
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )

    async def finish(self, child: asyncio.subprocess.Process) -> int:
        """Wait for ``child`` (bounded by :data:`CHILD_TIMEOUT_S`); keep what it printed; its exit status."""
        try:
            out, err = await asyncio.wait_for(child.communicate(), CHILD_TIMEOUT_S)
        except TimeoutError:
            child.kill()
            await child.wait()
            raise
        self.printed.append(out.decode(errors="replace") + err.decode(errors="replace"))
        return int(child.returncode if child.returncode is not None else -1)

    async def run(self, *settings: str) -> int:
        """One child run to its end; its exit status."""
        return await self.finish(await self.start(*settings))

    def requests(self) -> int:
        return self.dep.stats("calc_env").requests

    def ledger_into(self, figures: ScenarioFigures) -> bool:
        """Fill the ledger figures; True when lost, missing, duplicates and corrupt are all 0."""
        report = check_run(self.out)
        figures.lost, figures.missing = report.lost, report.missing
        figures.duplicates, figures.corrupt = report.duplicates, report.corrupt_lines
        figures.failure_records = failure_records(self.out)
        return (report.lost, report.missing, report.duplicates, report.corrupt_lines) == (0, 0, 0, 0)


_SETTINGS = ("+shard_size=100", "+max_resident_tasks=16")


async def _outage(lab: _Lab, outage_s: float) -> ScenarioFigures:
    figures = ScenarioFigures("outage")
    child = await lab.start(*_SETTINGS, "+server_outage_timeout_s=300")
    try:
        await until(lambda: lab.requests() >= lab.rows // 4, "a quarter of the rows")
        await lab.dep.stop_server("calc_env")
        await asyncio.sleep(outage_s)  # the length of the outage (the fault itself)
        await lab.dep.restart_server("calc_env")
        back, before = time.monotonic(), lab.requests()
        await until(
            lambda: lab.requests() > before or child.returncode is not None, "a /run after the restart"
        )
        figures.recover_s = round(time.monotonic() - back, 2)
    finally:
        figures.exit_statuses.append(await lab.finish(child))
    ok = lab.ledger_into(figures)
    figures.wasted_requests = lab.requests() - lab.rows
    figures.note = f"down {outage_s:g} s"
    figures.passed = ok and figures.exit_statuses == [0] and figures.failure_records == 0
    return figures


async def _outage_timeout(lab: _Lab) -> ScenarioFigures:
    figures = ScenarioFigures("outage-timeout")
    settings = (*_SETTINGS, "+server_outage_timeout_s=2")
    child = await lab.start(*settings)
    try:
        await until(lambda: lab.requests() >= lab.rows // 4, "a quarter of the rows")
        await lab.dep.stop_server("calc_env")
    finally:
        figures.exit_statuses.append(await lab.finish(child))
    await lab.dep.restart_server("calc_env")
    started = time.monotonic()
    figures.exit_statuses.append(await lab.run(*settings))
    figures.recover_s = round(time.monotonic() - started, 2)
    ok = lab.ledger_into(figures)
    figures.wasted_requests = lab.requests() - lab.rows
    named = "environment server 'calc_env'" in lab.printed[0]
    figures.note = "first run named the server" if named else "first run did not name the server"
    figures.passed = ok and figures.exit_statuses == [4, 0] and named and figures.failure_records == 0
    return figures


async def _busy_folder(lab: _Lab) -> ScenarioFigures:
    figures = ScenarioFigures("busy-folder")
    first = await lab.start(*_SETTINGS)
    try:
        await until(lambda: lab.requests() >= 10, "the first run to send")
        # Hold the first run mid-way (its rows wait for the server), so the second surely meets it.
        await lab.dep.stop_server("calc_env")
        # No server probe: the folder lock, not the stopped server, must be what refuses it.
        figures.exit_statuses.append(await lab.run(*_SETTINGS, "+health_check=false"))
        await lab.dep.restart_server("calc_env")
    finally:
        figures.exit_statuses.insert(0, await lab.finish(first))
    ok = lab.ledger_into(figures)
    counts = lab.dep.stats("calc_env").request_counts
    twice = sum(count - 1 for count in counts.values() if count > 1)
    figures.wasted_requests = lab.requests() - lab.rows
    refused = "is in use by another run" in lab.printed[0]
    figures.note = f"/run executed twice: {twice}; second run {'refused' if refused else 'NOT refused'}"
    figures.passed = ok and figures.exit_statuses == [0, 2] and refused and twice == 0
    return figures


def _seeded(config: dict[str, Any]) -> dict[str, Any]:
    seeded: dict[str, Any] = json.loads(json.dumps(config))
    seeded["policy_api_key"] = SEEDED_SECRETS[0]
    seeded["database"] = {"user": "gym", "Password": SEEDED_SECRETS[1]}
    seeded["calc_env"]["environment_servers"]["example_env"]["judge"] = {"auth_token": SEEDED_SECRETS[2]}
    return seeded


async def _secret(root: Path, rows: int) -> ScenarioFigures:
    import aiohttp

    figures = ScenarioFigures("secret")
    async with serve_config(_seeded(calc_config(seed=3))) as dep:
        head_only = {"head_server": {"host": "127.0.0.1", "port": int(dep.head_url.rsplit(":", 1)[1])}}
        lab = _Lab(root, dep, rows, config=head_only)
        figures.exit_statuses.append(await lab.run(*_SETTINGS))
        async with (
            aiohttp.ClientSession() as session,
            session.get(dep.head_url + "/global_config_dict_yaml") as r,
        ):
            reply = await r.text()
        ok = lab.ledger_into(figures)
        figures.wasted_requests = lab.requests() - rows
    texts = [reply, *lab.printed]
    texts += [p.read_text(errors="replace") for p in lab.out.rglob("*") if p.is_file()]
    hits = sum(text.count(secret) for text in texts for secret in SEEDED_SECRETS)
    figures.note = (
        f"secret hits: {hits} in the head's reply, {len(texts) - 1 - len(lab.printed)} files, output"
    )
    figures.passed = ok and figures.exit_statuses == [0] and hits == 0
    return figures


async def _quarantine(lab: _Lab) -> ScenarioFigures:
    figures = ScenarioFigures("quarantine")
    figures.exit_statuses.append(await lab.run(*_SETTINGS))
    shard = lab.out / "rollouts-00000.jsonl"
    lines = shard.read_bytes().splitlines(keepends=True)
    garbage = [b'{"_ng_task_index": 3, "result": {"reward": 1.0\x00\xff torn\n', b"not json at all\n"]
    shard.write_bytes(b"".join([*lines[:4], garbage[0], *lines[5:10], garbage[1], *lines[10:]]))
    before = lab.requests()
    started = time.monotonic()
    figures.exit_statuses.append(await lab.run(*_SETTINGS))
    figures.recover_s = round(time.monotonic() - started, 2)
    quarantine = shard.with_name(shard.name + ".quarantine")
    quarantined = len(quarantine.read_bytes().splitlines()) if quarantine.exists() else 0
    ok = lab.ledger_into(figures)
    rerun = lab.requests() - before
    figures.wasted_requests = lab.requests() - lab.rows - 1  # the lost line's rollout runs again by design
    figures.note = f"quarantined {quarantined} lines, rerun {rerun} rollout(s)"
    figures.passed = ok and figures.exit_statuses == [0, 0] and quarantined == 2 and rerun == 1
    return figures


async def _kill_resume(lab: _Lab) -> ScenarioFigures:
    figures = ScenarioFigures("kill-resume")
    for fraction in (0.15, 0.45, 0.75):
        child = await lab.start(*_SETTINGS)
        try:
            target = int(lab.rows * fraction)
            await until(lambda t=target: lab.requests() >= t, f"{target} requests")  # type: ignore[misc]
        finally:
            child.kill()  # SIGKILL: no cleanup runs
            figures.exit_statuses.append(await lab.finish(child))
    started = time.monotonic()
    figures.exit_statuses.append(await lab.run(*_SETTINGS))
    figures.recover_s = round(time.monotonic() - started, 2)
    ok = lab.ledger_into(figures)
    figures.wasted_requests = lab.requests() - lab.rows
    leftovers = temp_leftovers(lab.out)
    figures.note = f"temp folders left: {len(leftovers)}"
    figures.passed = ok and figures.exit_statuses[-1] == 0 and not leftovers
    return figures


async def _scenario(name: str, root: Path, rows: int, outage_s: float) -> ScenarioFigures:
    if name == "secret":
        return await _secret(root, rows)
    latency_ms = 5
    async with serve_config(calc_config(seed=3, latency_ms=latency_ms, latency_jitter_ms=0)) as dep:
        lab = _Lab(root, dep, rows)
        runs: dict[str, Callable[[], Awaitable[ScenarioFigures]]] = {
            "outage": lambda: _outage(lab, outage_s),
            "outage-timeout": lambda: _outage_timeout(lab),
            "busy-folder": lambda: _busy_folder(lab),
            "quarantine": lambda: _quarantine(lab),
            "kill-resume": lambda: _kill_resume(lab),
        }
        return await runs[name]()


_COLUMNS = (
    ("scenario", 15),
    ("exit", 12),
    ("lost", 5),
    ("missing", 8),
    ("dups", 5),
    ("corrupt", 8),
    ("wasted", 7),
    ("failures", 9),
    ("recover_s", 10),
    ("result", 7),
)


def format_table(results: Sequence[ScenarioFigures]) -> str:
    """The figures as a text table, one row per scenario, its note below it."""
    lines = ["".join(name.ljust(width) for name, width in _COLUMNS).rstrip()]
    for f in results:
        cells = (
            f.scenario,
            ",".join(str(s) for s in f.exit_statuses),
            f.lost,
            f.missing,
            f.duplicates,
            f.corrupt,
            f.wasted_requests,
            f.failure_records,
            "-" if f.recover_s is None else f"{f.recover_s:.2f}",
            "pass" if f.passed else "FAIL",
        )
        lines.append(
            "".join(str(cell).ljust(width) for cell, (_, width) in zip(cells, _COLUMNS, strict=True))
        )
        if f.note:
            lines.append(f"  {f.note}")
    return "\n".join(lines)


def run_chaos_bench(
    scenarios: Sequence[str] = CHAOS_SCENARIOS, *, rows: int = 2000, outage_s: float = 20.0
) -> dict[str, Any]:
    """Run ``scenarios`` one after the other, print their table, return the figures.

    Args:
        scenarios: Names from :data:`CHAOS_SCENARIOS`.
        rows: Rows per run (at least 40: the faults are placed by fractions of the rows).
        outage_s: How long the ``outage`` scenario keeps the server down.

    Returns:
        ``{"scenarios": [figures as dicts], "passed": all passed}``.

    Raises:
        UsageError: An unknown scenario or fewer than 40 rows.
    """
    unknown = [name for name in scenarios if name not in CHAOS_SCENARIOS]
    if unknown or rows < 40:
        raise UsageError(
            f"gym-ray bench chaos: unknown scenario(s) {unknown} (known: {', '.join(CHAOS_SCENARIOS)})"
            if unknown
            else f"gym-ray bench chaos: -n {rows} is too small; pass -n 40 or more"
        )

    async def main() -> list[ScenarioFigures]:
        results = []
        with tempfile.TemporaryDirectory(prefix="gym-ray-chaos-") as tmp:
            for name in scenarios:
                root = Path(tmp) / name
                root.mkdir()
                results.append(await _scenario(name, root, rows, outage_s))
        return results

    results = asyncio.run(main())
    print(format_table(results))
    return {"scenarios": [asdict(f) for f in results], "passed": all(f.passed for f in results)}
