"""Stage 0, the run config: YAML files and overrides in, one typed run config out.

Takes config paths or a dict plus ``key=value`` overrides; gives ``RunSettings`` (run knobs), ``Topology``
(servers and routing) and their parsing, checked once at the edge and passed down as objects.
"""
