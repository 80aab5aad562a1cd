"""Stage 3, recording: outcomes in, durable shard files out, and the readers of a run folder.

Takes each rollout's outcome; gives locked append-only shard files (``writer``), the run folder's lock, state
file and run record, and the ledger, status and resume readers. Merging and aggregating the shards is the
next stage's (:mod:`gym_ray.finalize`).
"""
