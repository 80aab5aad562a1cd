"""The honest floor of ``gym-ray bench pipeline``: a bare aiohttp loop, run as a script of its own.

``python _floor.py URL INPUT OUTPUT CONCURRENCY`` reads ``INPUT`` (JSONL) one line at a time, POSTs each
row (parsed, then encoded again, as any client must) to ``URL`` with ``CONCURRENCY`` requests in flight
over one session (connector ``limit`` = concurrency), parses each reply and appends it as one line to
``OUTPUT``, and prints ``{"done": replies, "startup_cpu_s": CPU spent before the loop began,
"peak_rss_mb": its own peak RSS (VmHWM)}`` as JSON. Nothing else: no validation, no numbering, no locks,
no fsync, no merge. It imports nothing from gym_ray (run it by path), so its CPU and memory are the
loop's.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import IO

import aiohttp


async def floor_loop(url: str, rows: IO[bytes], out: IO[str], concurrency: int) -> int:
    """POST every line of ``rows`` to ``url``; append each reply to ``out``; return the count."""
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0, keepalive_timeout=15.0)
    timeout = aiohttp.ClientTimeout(total=900.0, connect=10.0, sock_connect=10.0)
    headers = {"Content-Type": "application/json"}
    done = 0
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, cookie_jar=aiohttp.DummyCookieJar()
    ) as session:

        async def worker() -> None:
            nonlocal done
            for line in rows:  # the workers share one file iterator: each line is read once
                body = json.dumps(json.loads(line)).encode()
                async with session.post(url, data=body, headers=headers) as resp:
                    resp.raise_for_status()
                    reply = json.loads(await resp.read())
                out.write(json.dumps(reply) + "\n")
                done += 1

        async with asyncio.TaskGroup() as group:
            for _ in range(concurrency):
                group.create_task(worker())
    return done


def _peak_rss_mb() -> float:
    """Own peak RSS in MB: Linux ``VmHWM`` (``ru_maxrss`` would carry the parent's size across exec)."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmHWM in /proc/self/status: the floor loop measures memory on Linux only")


if __name__ == "__main__":
    startup_cpu_s = time.process_time()
    url, input_path, output_path, concurrency = sys.argv[1:5]
    with open(input_path, "rb") as rows, open(output_path, "w", encoding="utf-8") as out:
        done = asyncio.run(floor_loop(url, rows, out, int(concurrency)))
    print(json.dumps({"done": done, "startup_cpu_s": startup_cpu_s, "peak_rss_mb": _peak_rss_mb()}))
