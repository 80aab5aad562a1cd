"""The settings that name a file or folder, and which URLs they take (an object-store run folder only)."""

from __future__ import annotations

import re

from gym_ray.errors import ConfigError

__all__ = ["PATH_SETTINGS", "check_path_setting", "check_store_folder_alone"]

#: ``scheme://`` at the start of a path setting: a URL, not a path (``s3://``, ``gs://``, ``file://``, ...).
_URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")
#: The settings that name a file or folder of this machine's (or the cluster's shared) file system.
PATH_SETTINGS = ("output_dir", "output_jsonl_fpath", "input_jsonl_fpath")


def check_path_setting(key: str, value: str | None) -> str | None:
    """``value`` if ``key`` may hold it: a path, or for ``output_dir`` an ``s3://BUCKET/PREFIX`` too.

    Raises:
        ValueError: Another URL (pydantic names the key), with what to give instead.
    """
    match = None if value is None else _URL_SCHEME.match(value)
    if match is None:
        return value
    scheme = match.group(1)
    if key == "output_dir" and scheme.lower() == "s3":
        from gym_ray.store.objects import parse_store_url

        try:
            parse_store_url(str(value))
        except ConfigError as exc:
            raise ValueError(str(exc).partition(": ")[2] or str(exc)) from None
        return value
    where = (
        "give a local path or s3://BUCKET/PREFIX (any S3-compatible store through AWS_ENDPOINT_URL)"
        if key == "output_dir"
        else "give a path on a file system (on a cluster, one every node mounts: cluster/README.md)"
    )
    raise ValueError(f"a {scheme}:// URL is not supported here: {where}")


def check_store_folder_alone(output_dir: str | None, output_jsonl_fpath: str | None) -> None:
    """Refuse ``output_jsonl_fpath`` beside a store ``output_dir`` (the store folder holds the output).

    Raises:
        ValueError: Both are set and ``output_dir`` is a URL.
    """
    if output_jsonl_fpath is not None and _URL_SCHEME.match(output_dir or ""):
        raise ValueError(
            f"output_jsonl_fpath={output_jsonl_fpath!r} with output_dir={output_dir!r}: a run folder on an "
            "object store holds its own rollouts.jsonl; leave output_jsonl_fpath unset"
        )
