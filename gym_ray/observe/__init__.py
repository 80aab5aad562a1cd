"""Watching a run: tracing, metrics, progress and notebook helpers.

Takes a run's events (spans, counters, recorded files); gives OpenTelemetry spans and metrics (``tracing``),
a live progress line (``progress``) and tables and plots for notebooks (``notebook``).
"""
