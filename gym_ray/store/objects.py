"""An S3 bucket prefix seen as a run folder's store: whole objects, conditional writes, a request count.

``s3://bucket/prefix`` names the folder. The client is boto3's, so credentials and endpoint come from the
SDK's own chain (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``
and the config files, instance and pod roles; ``AWS_ENDPOINT_URL`` or ``AWS_ENDPOINT_URL_S3`` for an
S3-compatible store such as MinIO, Ceph or moto). gym_ray keeps only the URL: no credential is written to
the run folder, a log, a span or a status line.

Two conditional writes carry the exactly-once promise (see :mod:`gym_ray.store.segments`):
``PutObject`` with ``If-None-Match: *`` creates an object only if the key is free, and with
``If-Match: <etag>`` replaces it only if nobody replaced it since. A refused one raises
:class:`StoreConflict`; the store itself decides, so two writers on two machines cannot both win.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gym_ray.errors import ConfigError, RecordError

__all__ = ["SUPPORTED_SCHEMES", "ObjectStore", "StoreConflict", "StoreError", "StoreUrl", "parse_store_url"]

#: Schemes a run folder may use besides a local path.
SUPPORTED_SCHEMES = ("s3",)

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
#: Files at least this large go up as a multipart upload (the object appears whole when it completes).
MULTIPART_THRESHOLD = 64 * 1024 * 1024


class StoreError(RecordError):
    """The run folder's object store could not be reached, read or written."""


class StoreConflict(StoreError):
    """A conditional write was refused: the key exists (create) or changed since it was read (replace)."""


@dataclass(frozen=True)
class StoreUrl:
    """A parsed ``s3://bucket/prefix`` (the prefix without slashes at either end; may be empty)."""

    scheme: str
    bucket: str
    prefix: str

    def __str__(self) -> str:
        return (
            f"{self.scheme}://{self.bucket}/{self.prefix}"
            if self.prefix
            else f"{self.scheme}://{self.bucket}"
        )

    def key(self, name: str) -> str:
        """The object key of ``name`` (a path relative to the run folder)."""
        return f"{self.prefix}/{name}" if self.prefix else name


def parse_store_url(url: str, *, key: str = "output_dir") -> StoreUrl:
    """Parse and check an object-store run folder URL.

    Raises:
        ConfigError: Another scheme, a bucket name S3 does not allow, credentials in the URL, or ``..`` in
            the prefix; the message says what to give.
    """
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SUPPORTED_SCHEMES:
        raise ConfigError(
            f"{key}={url!r}: {scheme}:// is not supported; a run folder is a local path or s3://BUCKET/PREFIX"
            " (any S3-compatible store through AWS_ENDPOINT_URL)",
            key=key,
        )
    bucket, _, prefix = rest.partition("/")
    if "@" in bucket or ":" in bucket:
        raise ConfigError(
            f"{key}: put no credentials or port in the URL; the store's endpoint and credentials come from "
            "the AWS SDK's environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, profiles, roles)",
            key=key,
        )
    if not _BUCKET.fullmatch(bucket):
        raise ConfigError(
            f"{key}={url!r}: {bucket!r} is not an S3 bucket name (3-63 of a-z 0-9 . -)", key=key
        )
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise ConfigError(f"{key}={url!r}: the prefix may not hold empty, '.' or '..' parts", key=key)
    return StoreUrl(scheme.lower(), bucket, prefix)


class ObjectStore:
    """The objects under one run folder URL, through one boto3 client (thread-safe; counts its requests).

    Args:
        url: The run folder.
        client: A boto3 S3 client; default: ``boto3.client("s3")`` from the SDK's environment.
    """

    def __init__(self, url: StoreUrl | str, client: Any = None) -> None:
        self.url = url if isinstance(url, StoreUrl) else parse_store_url(url)
        if client is None:
            try:
                import boto3
            except ImportError as exc:
                raise ConfigError(
                    f"a run folder on {self.url.scheme}:// needs boto3: pip install boto3 (or gym-ray's s3 "
                    "extra, pip install -e '.[s3]' in its checkout)",
                    key="output_dir",
                ) from exc
            from botocore.config import Config

            client = boto3.client("s3", config=Config(retries={"mode": "standard", "max_attempts": 5}))
        self._client = client
        self._lock = threading.Lock()
        self.requests = 0  # requests sent by this object (retries by the SDK not included)
        from botocore.exceptions import BotoCoreError, ClientError

        self._errors = (BotoCoreError, ClientError)

    def _call(self, what: str, name: str, fn: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.requests += 1
        try:
            return fn(Bucket=self.url.bucket, **kwargs)
        except self._errors as exc:
            code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                raise StoreConflict(f"{self.url}: {what} {name}: the object changed meanwhile") from exc
            if code in ("NoSuchKey", "404", "NotFound"):
                raise FileNotFoundError(f"{self.url.key(name)}") from exc
            raise StoreError(f"{self.url}: {what} {name} failed: {_reason(exc)}") from exc

    def check(self) -> None:
        """Reach the bucket once (refuses a missing bucket or bad credentials before anything runs).

        Raises:
            StoreError: The bucket cannot be listed; the message says how the SDK failed.
        """
        self._call("listing", "the bucket", self._client.list_objects_v2, Prefix=self.url.key(""), MaxKeys=1)

    def get(self, name: str) -> tuple[bytes, str] | None:
        """The object's bytes and ETag, or None when there is none."""
        try:
            reply = self._call("reading", name, self._client.get_object, Key=self.url.key(name))
        except FileNotFoundError:
            return None
        return reply["Body"].read(), reply["ETag"]

    def put(self, name: str, data: bytes, *, create: bool = False, if_match: str | None = None) -> str:
        """Write a whole object; returns its ETag.

        Args:
            create: Only if no object has the key (``If-None-Match: *``).
            if_match: Only if the object's ETag is still this one.

        Raises:
            StoreConflict: The condition did not hold; nothing was written.
        """
        extra: dict[str, str] = {}
        if create:
            extra["IfNoneMatch"] = "*"
        if if_match is not None:
            extra["IfMatch"] = if_match
        reply = self._call(
            "writing", name, self._client.put_object, Key=self.url.key(name), Body=data, **extra
        )
        return str(reply["ETag"])

    def upload(self, name: str, path: Path) -> None:
        """Write a local file as one object; a large one goes up in parts and appears only when complete."""
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(
            multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_THRESHOLD
        )
        size = path.stat().st_size
        if size >= MULTIPART_THRESHOLD:  # create, each part, complete: all but the one _call counts
            with self._lock:
                self.requests += -(-size // MULTIPART_THRESHOLD) + 1
        self._call(
            "writing",
            name,
            lambda **kw: self._client.upload_file(str(path), kw["Bucket"], kw["Key"], Config=config),
            Key=self.url.key(name),
        )

    def download(self, name: str, path: Path) -> None:
        """Copy an object into a local file (written beside it, then renamed into place)."""
        reply = self._call("reading", name, self._client.get_object, Key=self.url.key(name))
        part = path.with_name(path.name + ".part")
        with part.open("wb") as out:
            for chunk in reply["Body"].iter_chunks(1 << 20):
                out.write(chunk)
        part.replace(path)

    def listing(self, under: str = "") -> dict[str, tuple[int, str]]:
        """Every object under ``under`` (relative to the run folder): name -> (size, ETag)."""
        found: dict[str, tuple[int, str]] = {}
        base = self.url.key(under)
        strip = len(self.url.key(""))
        token: str | None = None
        while True:
            extra = {"ContinuationToken": token} if token else {}
            reply = self._call(
                "listing", under or "the folder", self._client.list_objects_v2, Prefix=base, **extra
            )
            for item in reply.get("Contents", ()):
                found[item["Key"][strip:]] = (int(item["Size"]), str(item["ETag"]))
            if not reply.get("IsTruncated"):
                return found
            token = reply["NextContinuationToken"]

    def delete(self, name: str) -> None:
        """Remove an object (no error when there is none)."""
        self._call("deleting", name, self._client.delete_object, Key=self.url.key(name))


def _reason(exc: BaseException) -> str:
    """A one-line reason from a boto error, with the SDK's hint for missing credentials kept."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if type(exc).__name__ == "NoCredentialsError":
        text += " (set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run with an instance role)"
    if type(exc).__name__ == "EndpointConnectionError":
        text += " (check AWS_ENDPOINT_URL)"
    return text
