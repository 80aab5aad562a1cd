"""Stage 3, recording: outcomes in, durable shard files, merged rollouts and metrics out.

Takes each rollout's outcome; gives locked append-only shard files (``writer``), the merged files
(``merge``), one metrics file from ``/aggregate_metrics`` (``aggregate``), and the ledger and status readers.
"""
