"""Stage 4, finishing a run (the coordinator's work): shard files in, merged rollouts and metrics out.

Takes a run folder whose shards are written; gives the merged ``rollouts.jsonl`` /
``rollouts_failures.jsonl`` (``merge``), one metrics file from ``/aggregate_metrics`` per environment server
(``aggregate``; ``gym-ray aggregate`` is ``aggregate_command``), NeMo Gym's output layout (``nemo_layout``)
and its post-run quality pass (``quality``).
"""
