"""The merge's sorting processes do not run the caller's main script again (``gym_ray._spawn``).

Checked with a real script as ``__main__``: its unguarded top level appends the pid of whoever runs it to a
file, and its guarded part merges a run folder with a two-process pool. Without the guard of
``main_script_not_rerun`` a spawned child imports the main script as ``__mp_main__`` and appends its own
pid (measured on the code before: two lines); in a Ray actor that script is Ray's ``default_worker.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.record.test_merge import rec, write_shard

SCRIPT = """
import os, sys
with open(sys.argv[2], "a") as marker:
    marker.write(f"{os.getpid()}\\n")
if __name__ == "__main__":
    import json
    from gym_ray.record.merge import merge_shards
    result = merge_shards(sys.argv[1], workers=2, pool_min_bytes=0)
    print(json.dumps({"successes": result.successes, "pid": os.getpid()}))
"""


def test_a_merge_pool_does_not_run_the_main_script_again(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    for shard in range(4):
        write_shard(run_dir, f"{shard:05d}", [rec(shard * 10 + i, 0) for i in range(10)])
    script = tmp_path / "main_script.py"
    script.write_text(SCRIPT)
    marker = tmp_path / "ran.txt"
    done = subprocess.run(
        [sys.executable, str(script), str(run_dir), str(marker)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["successes"] == 40
    assert marker.read_text().split() == [str(report["pid"])]  # the script's top level ran once, here
