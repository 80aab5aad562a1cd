"""Stage 1, planning: input rows in, validated, numbered shards on disk out.

Takes a JSONL file or rows and the topology; gives preprocessed rows (routing, repeats, task numbering),
validation errors before anything is dispatched, shards with materialized inputs, and what resume would run.
"""
