"""Stage 2, dispatch: rows in, one outcome per rollout out, in completion order.

Takes stamped rows and a ``ServerClient``; POSTs each to its environment server's ``/run`` with bounded
admission and gives results, typed failure records or drained placeholders (``outcomes``), enriched.
"""
