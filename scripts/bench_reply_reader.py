"""Reading a large ``/aggregate_metrics`` reply: gym_ray's ``json_stream.iter_object`` against ijson.

Writes a reply of ``--tasks`` group-level and repeat-level entries (about 28 MB at 100k), reads it with
each reader three times (best and every time, in seconds), and checks each gives the values ``json.loads``
gives. ijson (``pip install ijson``; its C backend) is read element by element as gym_ray streams the two
lists: with ``use_float=True`` (floats as Python floats) and in its exact mode (numbers as ``Decimal``,
converted to float), and whole (``kvitems``, no streaming) for reference. It also shows what each reader
does with ``NaN`` and with an integer beyond 64 bits, which ``json`` (and gym_ray) read.

Usage: ``python scripts/bench_reply_reader.py [--tasks 100000]`` (figures in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import decimal
import io
import json
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gym_ray.finalize.json_stream import iter_object

LISTS = ("group_level_metrics", "repeat_level_metrics")


def _reply(tasks: int) -> dict[str, Any]:
    rng = random.Random(1)
    groups = [
        {
            "task_index": i,
            "mean/reward": rng.random(),
            "max/reward": 1.0,
            "min/reward": 0.0,
            "count": 4,
            "pass@1": rng.random(),
            "pass@4": 1 if i % 3 else 0,
            "mean/num_tool_calls": rng.random() * 10,
            "name": f"t\u00e9sk-{i}",
        }
        for i in range(tasks)
    ]
    repeats = [{"rollout_index": i % 4, "mean/reward": rng.random()} for i in range(tasks)]
    return {
        "agent_metrics": {"mean/reward": 0.5},
        "key_metrics": {"mean/reward": 0.5},
        "group_level_metrics": groups,
        "repeat_level_metrics": repeats,
        "perf_summary": {"tiny": 1e-300, "negative_zero": -0.0},
    }


def _to_float(value: Any) -> Any:
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, dict):
        return {k: _to_float(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_float(v) for v in value]
    return value


def main() -> None:
    import ijson  # optional: this script compares against it

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=100_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "reply.json")
        path.write_text(json.dumps(_reply(args.tasks)))
        expected = json.loads(path.read_text())
        size = path.stat().st_size
        print(f"reply: {size:,} bytes, {args.tasks:,} tasks; ijson {ijson.__version__} {ijson.backend}")

        def ours() -> dict[str, Any]:
            out: dict[str, Any] = {key: [] for key in LISTS}
            for key, value in iter_object(
                path, streamed={k: out[k].append for k in LISTS}, what="reply", hint="-"
            ):
                if key not in LISTS:
                    out[key] = value
            return out

        def ijson_streamed(exact: bool) -> Callable[[], dict[str, Any]]:
            def read() -> dict[str, Any]:
                out: dict[str, Any] = {}
                for key in LISTS:  # ijson streams one prefix per pass
                    with path.open("rb") as handle:
                        items = ijson.items(handle, key + ".item", use_float=not exact)
                        out[key] = [_to_float(e) for e in items] if exact else list(items)
                return out

            return read

        def ijson_whole() -> dict[str, Any]:
            with path.open("rb") as handle:
                return dict(ijson.kvitems(handle, "", use_float=True))

        readers = {
            "gym_ray iter_object (streamed)": ours,
            "ijson use_float=True (streamed)": ijson_streamed(exact=False),
            "ijson exact, Decimal -> float (streamed)": ijson_streamed(exact=True),
            "ijson kvitems (whole lists)": ijson_whole,
        }
        for name, read in readers.items():
            times = []
            for _ in range(3):
                started = time.perf_counter()
                got = read()
                times.append(time.perf_counter() - started)
            same = all(got[key] == expected[key] for key in LISTS)
            print(f"{name}: best {min(times):.3f} s ({', '.join(f'{t:.3f}' for t in times)}); same: {same}")
    for label, text in (("NaN", b'[{"a": NaN}]'), ("2**70", b'[{"a": 1180591620717411303424}]')):
        for mode, use_float in (("use_float", True), ("exact", False)):
            try:
                value = list(ijson.items(io.BytesIO(text), "item", use_float=use_float))
            except Exception as exc:  # what ijson raises is the point
                value = f"refused ({type(exc).__name__})"
            print(f"{label}: json {json.loads(text)}; ijson {mode}: {value}")


if __name__ == "__main__":
    main()
