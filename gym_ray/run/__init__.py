"""A whole run in one process: the config in, a ``RunResult`` out.

Takes a run config; plans, runs every shard (dispatch + record) and finalizes (merge + aggregate). The Ray
actors in :mod:`gym_ray.distributed` run these same building blocks, one shard at a time.
"""
