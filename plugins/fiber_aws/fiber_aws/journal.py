"""A durable run's journal in S3 (``journal = s3://bucket/prefix``): the core's ObjectStore over S3's conditional writes.

Credentials, region and endpoint come from where boto3 reads them (the environment,
``~/.aws``, an instance role; ``AWS_ENDPOINT_URL`` for a store other than AWS's). Writes
only if absent (``If-None-Match: *``) and only if unchanged (``If-Match``) are S3's
conditional requests.
"""

from __future__ import annotations

from typing import Any

from fiber_core.contract import ObjectStore

from fiber_aws.api import AwsError, call

_FAILED_CONDITION = {"PreconditionFailed", "ConditionalRequestConflict"}
_ABSENT = {"NoSuchKey", "404", "NotFound"}


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` as (bucket, prefix without slashes at its ends)."""
    if not url.startswith("s3://") or not url[5:].split("/", 1)[0]:
        raise ValueError(f"journal={url!r}: expected s3://bucket or s3://bucket/prefix")
    bucket, _, prefix = url[5:].partition("/")
    return bucket, prefix.strip("/")


class S3Store(ObjectStore):
    """The objects under ``s3://bucket/prefix``; an S3 error is an :class:`OSError` naming it."""

    def __init__(self, url: str, client: Any = None) -> None:
        self.bucket, self.prefix = parse_url(url)
        self.where = url
        if client is None:
            import boto3  # the plugin's SDK, loaded only when a journal is in S3

            client = boto3.client("s3")
        self._s3 = client

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _call(self, operation: str, **kwargs: Any) -> dict[str, Any]:
        try:
            return call(self._s3, operation, Bucket=self.bucket, **kwargs)
        except AwsError as e:
            raise OSError(f"{self.where}: {e}") from e

    def get(self, name: str) -> tuple[bytes, str] | None:
        try:
            resp = call(self._s3, "get_object", Bucket=self.bucket, Key=self._key(name))
        except AwsError as e:
            if e.code in _ABSENT:
                return None
            raise OSError(f"{self.where}: {e}") from e
        return resp["Body"].read(), resp["ETag"]

    def put(self, name: str, data: bytes, *, if_absent: bool = False,
            if_tag: str | None = None) -> str | None:
        kwargs: dict[str, Any] = {"Key": self._key(name), "Body": data}
        if if_absent:
            kwargs["IfNoneMatch"] = "*"
        if if_tag is not None:
            kwargs["IfMatch"] = if_tag
        try:
            return call(self._s3, "put_object", Bucket=self.bucket, **kwargs)["ETag"]
        except AwsError as e:
            if e.code in _FAILED_CONDITION:
                return None
            raise OSError(f"{self.where}: {e}") from e

    def delete(self, name: str, *, if_tag: str | None = None) -> bool:
        kwargs: dict[str, Any] = {"Key": self._key(name)}
        if if_tag is not None:
            kwargs["IfMatch"] = if_tag
        try:
            call(self._s3, "delete_object", Bucket=self.bucket, **kwargs)
        except AwsError as e:
            if e.code in _FAILED_CONDITION:
                return False
            if e.code in _ABSENT:
                return True
            raise OSError(f"{self.where}: {e}") from e
        return True

    def names(self, prefix: str = "") -> list[str]:
        start = self._key(prefix)
        skip = len(self.prefix) + 1 if self.prefix else 0
        out: list[str] = []
        kwargs: dict[str, Any] = {"Prefix": start}
        while True:
            resp = self._call("list_objects_v2", **kwargs)
            out += [obj["Key"][skip:] for obj in resp.get("Contents", [])]
            if not resp.get("IsTruncated"):
                return out
            kwargs["ContinuationToken"] = resp["NextContinuationToken"]
