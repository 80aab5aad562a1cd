"""`gym-ray bench store`: its count of the store's requests, read from moto's access log."""

from __future__ import annotations

from pathlib import Path

from gym_ray.bench.store_bench import _requests


def test_requests_are_counted_by_method_from_the_access_log(tmp_path: Path) -> None:
    log = tmp_path / "moto.log"
    log.write_text(
        " * Running on http://127.0.0.1:5055\n"
        '127.0.0.1 - - [04/Dec/2026 07:01:02] "PUT /bench/run/.gym_ray_shards/0/head.json HTTP/1.1" 200 -\n'
        '127.0.0.1 - - [04/Dec/2026 07:01:02] "GET /bench?list-type=2&prefix=run%2F HTTP/1.1" 200 -\n'
        '127.0.0.1 - - [04/Dec/2026 07:01:03] "PUT /bench/run/rollouts.jsonl HTTP/1.1" 412 -\n'
        "Traceback (most recent call last): a line that is not a request\n"
    )
    assert _requests(log) == {"PUT": 2, "GET": 1}
