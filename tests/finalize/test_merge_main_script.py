"""The merge's sorting processes do not run the caller's main script again (``gym_ray._spawn``).

Checked with a real script as ``__main__`` (``tests/main_script.py``): its unguarded top level notes the
pid of whoever runs it, and its guarded part merges a run folder with a two-process pool. Without
``main_script_not_rerun`` a spawned child imports the main script as ``__mp_main__`` and notes its own pid
(two pids on the code before); in a Ray actor that script is Ray's ``default_worker.py``.
"""

from __future__ import annotations

from pathlib import Path

from tests.finalize.test_merge import rec, write_shard
from tests.main_script import run_as_main_script

MERGE = """
if __name__ == "__main__":
    import json, sys
    from gym_ray.finalize.merge import merge_shards
    result = merge_shards(sys.argv[1], workers=2, pool_min_bytes=0)
    print(json.dumps({"successes": result.successes, "pid": os.getpid()}))
"""


def test_a_merge_pool_does_not_run_the_main_script_again(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    for shard in range(4):
        write_shard(run_dir, f"{shard:05d}", [rec(shard * 10 + i, 0) for i in range(10)])
    report, pids = run_as_main_script(tmp_path, MERGE, str(run_dir))
    assert report["successes"] == 40
    assert pids == [report["pid"]]  # the script's top level ran once, in the merging process
