"""Reading a Ray run's summary file in tests."""

from __future__ import annotations

import json
from pathlib import Path


def workers_that_dispatched(summary_path: str) -> set[str]:
    """The workers of a Ray run that sent rollouts, from its summary's shard timings.

    The hand-out is pull-based: on a loaded machine one worker can take every shard before another has
    started, so a test that counts processes compares with this, not with ``num_workers``.
    """
    summary = json.loads(Path(summary_path).read_text(encoding="utf-8"))
    return {t["worker"] for t in summary["distributed"]["shard_timings"] if t["dispatched"]}
