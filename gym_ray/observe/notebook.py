"""Notebook helpers: results as tables, a progress display, and plots.

- :func:`to_arrow` / :func:`to_pandas`: stream items, groups, or recorded lines as one table (a row per
  rollout: identity, server, reward, latency, failure class).
- :func:`load_run` / :func:`load_metrics`: a finished run folder's rollouts and aggregate metrics.
- :class:`Progress` / :func:`track`: a progress bar that renders in Jupyter (HTML, updated in place) and
  falls back to one plain text line elsewhere; it also counts completions per second for
  :func:`plot_throughput`.
- ``plot_*``: reward distribution per environment server, pass@k curves, latency histogram, throughput
  over time. matplotlib (and pandas for :func:`to_pandas`) are the optional ``gym-ray[plot]`` extra;
  calling a plot without it raises :class:`~gym_ray.errors.UsageError` saying what to install.

Every plot function returns the matplotlib ``Figure`` and, with ``path``, saves it there (PNG by suffix)
and closes it, so a notebook loop does not keep figures alive.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import re
import sys
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa

from gym_ray import keys
from gym_ray.dispatch.outcomes import RolloutFailureRecord
from gym_ray.errors import InputError, UsageError

__all__ = [
    "Progress",
    "load_metrics",
    "load_run",
    "pass_at_k_curves",
    "plot_latency_histogram",
    "plot_pass_at_k",
    "plot_reward_distribution",
    "plot_throughput",
    "to_arrow",
    "to_pandas",
    "track",
]

T = TypeVar("T")

#: Columns of :func:`to_arrow`, in order.
SCHEMA = pa.schema(
    [
        ("task_index", pa.int64()),
        ("rollout_index", pa.int64()),
        ("environment_server", pa.string()),
        ("agent", pa.string()),
        ("reward", pa.float64()),
        ("latency_ms", pa.float64()),
        ("failure_class", pa.string()),
    ]
)
_PASS_AT_K = re.compile(r"^pass@(\d+)/([^/]+)$")


def _flatten(results: Iterable[Any]) -> Iterable[Any]:
    for item in results:
        if isinstance(item, list):
            yield from item
        else:
            yield item


def _int_or_none(value: Any) -> int | None:
    return value if type(value) is int else None


def _row_of(position: int, item: Any) -> dict[str, Any]:
    if isinstance(item, tuple) and len(item) == 2:
        row, outcome = item
    elif isinstance(item, Mapping):
        row, outcome = item, item
    else:
        raise InputError(
            f"result {position} is a {type(item).__name__}; expected a (row, outcome) pair from "
            "gym_ray.stream, a group (list of pairs), or a recorded result dict",
            row=position,
        )
    agent_ref = row.get(keys.AGENT_REF) if isinstance(row, Mapping) else None
    agent = agent_ref.get("name") if isinstance(agent_ref, Mapping) else None
    if isinstance(outcome, RolloutFailureRecord):
        return {
            "task_index": outcome.task_index,
            "rollout_index": outcome.rollout_index,
            "environment_server": outcome.environment_server,
            "agent": outcome.agent or agent,
            "reward": None,
            "latency_ms": None,
            "failure_class": outcome.failure_class,
        }
    if not isinstance(outcome, Mapping):
        raise InputError(
            f"result {position}: the outcome is a {type(outcome).__name__}, not a dict", row=position
        )
    reward = outcome.get(keys.REWARD)
    perf = outcome.get(keys.NG_PERF)
    latency = perf.get("total_latency_ms") if isinstance(perf, Mapping) else None
    failure = outcome.get(keys.FAILURE_CLASS)
    server = outcome.get(keys.ENVIRONMENT_SERVER, row.get(keys.ENVIRONMENT_SERVER))
    return {
        "task_index": _int_or_none(outcome.get(keys.TASK_INDEX, row.get(keys.TASK_INDEX))),
        "rollout_index": _int_or_none(outcome.get(keys.ROLLOUT_INDEX, row.get(keys.ROLLOUT_INDEX))),
        "environment_server": server if isinstance(server, str) else None,
        "agent": agent if isinstance(agent, str) else None,
        "reward": float(reward) if isinstance(reward, int | float) and failure is None else None,
        "latency_ms": float(latency) if isinstance(latency, int | float) else None,
        "failure_class": failure if isinstance(failure, str) else None,
    }


def to_arrow(results: Iterable[Any]) -> pa.Table:
    """One table row per rollout, columns :data:`SCHEMA`.

    Args:
        results: ``(row, result | RolloutFailureRecord)`` pairs (what :func:`gym_ray.stream` yields),
            groups of them (lists), or recorded result / failure dicts (lines of a run folder).

    Raises:
        InputError: An item is none of these (names its position).
    """
    rows = [_row_of(i, item) for i, item in enumerate(_flatten(results))]
    return pa.Table.from_pylist(rows, schema=SCHEMA)


def to_pandas(results: Iterable[Any]) -> Any:
    """:func:`to_arrow` as a pandas ``DataFrame`` (needs pandas: ``pip install 'gym-ray[plot]'``)."""
    if importlib.util.find_spec("pandas") is None:
        raise UsageError("to_pandas needs pandas; install it with: pip install 'gym-ray[plot]'")
    return to_arrow(results).to_pandas()


def load_run(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every recorded line of a run folder: the merged ``rollouts.jsonl`` + ``rollouts_failures.jsonl``
    when present, else every shard's successes and failures.

    Raises:
        InputError: ``run_dir`` is not a folder.
    """
    from gym_ray.record.jsonl import JsonlReader
    from gym_ray.record.shard_files import list_shards, shard_paths

    root = Path(run_dir)
    if not root.is_dir():
        raise InputError(f"run folder {root} does not exist; pass the output_dir of a run", path=str(root))
    merged = [root / "rollouts.jsonl", root / "rollouts_failures.jsonl"]
    if not merged[0].exists():
        merged = []
        for shard in list_shards(root):
            paths = shard_paths(root, shard)
            merged += [paths.successes, paths.failures]
    return [record for path in merged for _, record in JsonlReader(path)]


def load_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The entries of a ``rollouts_aggregate_metrics.json`` (a run folder is accepted too).

    Raises:
        InputError: The file is missing or is not a JSON list.
    """
    file = Path(path)
    if file.is_dir():
        file = file / "rollouts_aggregate_metrics.json"
    try:
        entries = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read aggregate metrics {file}: {exc}", path=str(file)) from exc
    if not isinstance(entries, list):
        raise InputError(
            f"{file} holds a JSON {type(entries).__name__}, not a list of entries", path=str(file)
        )
    return entries


# --- progress ------------------------------------------------------------------------------------


def _in_notebook() -> bool:
    shell = sys.modules.get("IPython")
    if shell is None:
        return False
    ip = shell.get_ipython()
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


class Progress:
    """A progress bar: HTML updated in place in Jupyter, a text line (``\\r``) on a terminal stream.

    Also counts completions per whole second since creation (:attr:`per_second`), for
    :func:`plot_throughput`; memory grows with the run's duration, not with the number of rollouts.

    Args:
        total: Expected count, or None when unknown.
        description: Label shown before the bar.
        html: Force HTML (True) or text (False); default: HTML inside a Jupyter kernel.
        stream: Text fallback output (default ``sys.stderr``).
        clock: Monotonic clock.
    """

    def __init__(
        self,
        total: int | None = None,
        *,
        description: str = "rollouts",
        html: bool | None = None,
        stream: Any = None,
        clock: Any = time.monotonic,
    ) -> None:
        self.total = total
        self.description = description
        self.count = 0
        self.per_second: dict[int, int] = {}
        self._clock = clock
        self._started = clock()
        self._html = _in_notebook() if html is None else html
        self._stream = stream if stream is not None else sys.stderr
        self._handle: Any = None
        self._last_render = -math.inf

    def update(self, n: int = 1) -> None:
        """Count ``n`` completions now; redraw at most 10 times a second (and at ``total``)."""
        self.count += n
        now = self._clock()
        second = int(now - self._started)
        self.per_second[second] = self.per_second.get(second, 0) + n
        if now - self._last_render >= 0.1 or self.count == self.total:
            self._last_render = now
            self.render()

    def text(self) -> str:
        """The one-line text form: ``rollouts: 40/100 [####......] 12.3/s``."""
        elapsed = max(self._clock() - self._started, 1e-9)
        rate = f"{self.count / elapsed:.1f}/s"
        if not self.total:
            return f"{self.description}: {self.count} {rate}"
        filled = min(20, int(20 * self.count / self.total))
        return f"{self.description}: {self.count}/{self.total} [{'#' * filled}{'.' * (20 - filled)}] {rate}"

    def render(self) -> None:
        """Draw the current state (HTML display in a notebook, else a ``\\r`` text line)."""
        if self._html:
            ipython_display: Any = importlib.import_module("IPython.display")
            HTML, display = ipython_display.HTML, ipython_display.display
            value = self.count if self.total else 0
            maximum = self.total or 1
            html = HTML(
                f"<progress value='{value}' max='{maximum}' style='width:40%'></progress> "
                f"<code>{self.text()}</code>"
            )
            if self._handle is None:
                self._handle = display(html, display_id=True)
            else:
                self._handle.update(html)
            return
        self._stream.write("\r" + self.text())
        self._stream.flush()

    def close(self) -> None:
        """Final redraw (and a newline in text mode)."""
        self.render()
        if not self._html:
            self._stream.write("\n")
            self._stream.flush()


async def track(
    items: AsyncIterable[T], *, total: int | None = None, progress: Progress | None = None
) -> AsyncIterator[T]:
    """Yield ``items`` unchanged while a :class:`Progress` counts them (a group counts its length).

    Example::

        bar = Progress(total=200)
        results = [item async for item in track(gym_ray.stream(rows, config=cfg), progress=bar)]
    """
    bar = progress if progress is not None else Progress(total)
    try:
        async for item in items:
            bar.update(len(item) if isinstance(item, list) else 1)
            yield item
    finally:
        bar.close()


# --- plots ---------------------------------------------------------------------------------------


def _pyplot() -> Any:
    try:
        import matplotlib

        if "matplotlib.pyplot" not in sys.modules and not _in_notebook():
            matplotlib.use("Agg")  # no display outside notebooks: render to files
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise UsageError("plots need matplotlib; install it with: pip install 'gym-ray[plot]'") from exc
    return plt


def _finish(plt: Any, fig: Any, path: str | os.PathLike[str] | None) -> Any:
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        plt.close(fig)
    return fig


def _table(results: Any) -> pa.Table:
    return results if isinstance(results, pa.Table) else to_arrow(results)


def plot_reward_distribution(results: Any, *, path: str | os.PathLike[str] | None = None) -> Any:
    """Histogram of rewards per environment server (failures excluded).

    Args:
        results: A :func:`to_arrow` table, or anything :func:`to_arrow` accepts.
        path: Save the figure here (and close it).
    """
    plt = _pyplot()
    data = _table(results).to_pylist()
    servers = sorted({r["environment_server"] or "?" for r in data if r["reward"] is not None})
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for server in servers:
        rewards = [
            r["reward"]
            for r in data
            if (r["environment_server"] or "?") == server and r["reward"] is not None
        ]
        ax.hist(
            rewards,
            bins=10,
            range=(0.0, 1.0),
            alpha=0.6,
            label=f"{server} (mean {sum(rewards) / len(rewards):.2f})",
        )
    ax.set_xlabel("reward")
    ax.set_ylabel("rollouts")
    ax.set_title("Reward distribution per environment server")
    if servers:
        ax.legend()
    return _finish(plt, fig, path)


def pass_at_k_curves(entries: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """``server -> [(k, pass@k %)]`` from aggregate metric entries (score ``accuracy`` when present)."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for entry in entries:
        metrics = entry.get("agent_metrics") or {}
        found: dict[str, list[tuple[int, float]]] = {}
        for name, value in metrics.items():
            match = _PASS_AT_K.match(name)
            if match and isinstance(value, int | float):
                found.setdefault(match.group(2), []).append((int(match.group(1)), float(value)))
        if found:
            score = "accuracy" if "accuracy" in found else sorted(found)[0]
            server = str(entry.get(keys.ENVIRONMENT_SERVER) or entry.get(keys.AGENT_REF, {}).get("name"))
            curves[server] = sorted(found[score])
    return curves


def plot_pass_at_k(metrics: Any, *, path: str | os.PathLike[str] | None = None) -> Any:
    """pass@k against k, one line per environment server.

    Args:
        metrics: A ``rollouts_aggregate_metrics.json`` path, a run folder, or its loaded entries.
        path: Save the figure here (and close it).

    Raises:
        InputError: No entry has ``pass@k`` metrics.
    """
    entries = load_metrics(metrics) if isinstance(metrics, str | os.PathLike) else list(metrics)
    curves = pass_at_k_curves(entries)
    if not curves:
        raise InputError(
            "no aggregate metric entry has pass@k values (agent_metrics 'pass@<k>/<score>'); "
            "collect with num_repeats >= 1 against servers that report them"
        )
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for server, points in sorted(curves.items()):
        ax.plot([k for k, _ in points], [v for _, v in points], marker="o", label=server)
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k (%)")
    ax.set_ylim(0, 100)
    ax.set_title("pass@k per environment server")
    ax.legend()
    return _finish(plt, fig, path)


def plot_latency_histogram(results: Any, *, path: str | os.PathLike[str] | None = None) -> Any:
    """Histogram of ``/run`` latencies (ms) of the rollouts that have one."""
    plt = _pyplot()
    latencies = [v for v in _table(results).column("latency_ms").to_pylist() if v is not None]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(latencies, bins=20)
    ax.set_xlabel("/run latency (ms)")
    ax.set_ylabel("rollouts")
    ax.set_title(f"Latency ({len(latencies)} rollouts)")
    return _finish(plt, fig, path)


def plot_throughput(
    progress: Progress | Mapping[int, int], *, path: str | os.PathLike[str] | None = None
) -> Any:
    """Completions per second over time, from a :class:`Progress` (or its ``per_second`` mapping)."""
    plt = _pyplot()
    bins = progress.per_second if isinstance(progress, Progress) else progress
    last = max(bins, default=0)
    seconds = list(range(last + 1))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(seconds, [bins.get(s, 0) for s in seconds], width=0.9)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("rollouts / s")
    ax.set_title("Throughput over time")
    return _finish(plt, fig, path)
