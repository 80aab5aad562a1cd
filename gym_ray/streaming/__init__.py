"""The stream for trainers and notebooks: rows in, ``(row, outcome)`` pairs out in completion order.

Takes rows (a list, an iterator, or a ``RowFeed`` filled while it runs); gives outcomes from Ray stream
workers through a bounded buffer with backpressure, optional groups and recording. Sync wrapper: ``sync``.
"""
