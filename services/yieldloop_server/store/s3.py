"""S3 object store through boto3 (AWS S3, MinIO, moto_server, ...).

Endpoint, region and credentials come from the usual AWS configuration
(``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID``, profiles, ...).
Large objects go up in parallel multipart uploads and come down in parallel
ranged downloads; throttling and transient errors are retried (botocore's
adaptive mode). Conditional puts use S3's ``If-None-Match: *`` and
``If-Match: <etag>`` (412 on mismatch).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile
from collections.abc import Iterator
from typing import Any

from yieldloop_server.store.base import ObjectNotFound, ObjectStat, ObjectStore, PreconditionFailed, check_key

_MiB = 1 << 20


def _code(err: Any) -> tuple[str, int]:
    response = err.response
    return response.get("Error", {}).get("Code", ""), response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)


class S3Store(ObjectStore):
    """Objects under ``s3://bucket/prefix``.

    Args:
        bucket: Bucket name (it must exist).
        prefix: Key prefix inside the bucket ("" or ending without a slash).
        endpoint_url: Overrides the AWS configuration's endpoint (e.g. a local moto_server).
        multipart_threshold_bytes: Objects larger than this upload in parts.
        max_concurrency: Parallel part uploads/downloads per transfer.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        multipart_threshold_bytes: int = 64 * _MiB,
        max_concurrency: int = 8,
    ) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.client = boto3.client(
            "s3",
            endpoint_url=endpoint_url,
            config=Config(retries={"max_attempts": 10, "mode": "adaptive"}, max_pool_connections=max_concurrency * 2),
        )
        self.transfer = TransferConfig(
            multipart_threshold=multipart_threshold_bytes,
            multipart_chunksize=16 * _MiB,
            max_concurrency=max_concurrency,
        )

    def __repr__(self) -> str:
        return f"S3Store(s3://{self.bucket}/{self.prefix})"

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    def put_bytes(self, key: str, data: bytes, *, if_match: str | None = None, if_none_match: bool = False) -> str:
        from botocore.exceptions import ClientError

        conditions: dict[str, str] = {}
        if if_none_match:
            conditions["IfNoneMatch"] = "*"
        if if_match is not None:
            conditions["IfMatch"] = if_match
        try:
            response = self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **conditions)
        except ClientError as err:
            code, status = _code(err)
            if status == 412 or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise PreconditionFailed(f"{key}: {code}") from None
            if if_match is not None and code in ("NoSuchKey", "404"):
                raise PreconditionFailed(f"{key} no longer exists") from None
            raise
        return response["ETag"]

    def get_bytes(self, key: str) -> tuple[bytes, str]:
        from botocore.exceptions import ClientError

        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as err:
            if _code(err)[0] in ("NoSuchKey", "404"):
                raise ObjectNotFound(key) from None
            raise
        return response["Body"].read(), response["ETag"]

    def put_file(self, key: str, path: pathlib.Path) -> str:
        self.client.upload_file(str(path), self.bucket, self._key(key), Config=self.transfer)
        stat = self.stat(key)
        assert stat is not None
        return stat.etag

    def get_file(self, key: str, path: pathlib.Path) -> None:
        from botocore.exceptions import ClientError

        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        os.close(fd)
        try:
            self.client.download_file(self.bucket, self._key(key), tmp, Config=self.transfer)
            os.replace(tmp, path)
        except ClientError as err:
            if _code(err)[0] in ("NoSuchKey", "404"):
                raise ObjectNotFound(key) from None
            raise
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def stat(self, key: str) -> ObjectStat | None:
        from botocore.exceptions import ClientError

        try:
            response = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as err:
            if _code(err)[0] in ("NoSuchKey", "404", "NotFound"):
                return None
            raise
        return ObjectStat(
            key=key,
            size=response["ContentLength"],
            etag=response["ETag"],
            modified=response["LastModified"].timestamp(),
        )

    def list(self, prefix: str) -> Iterator[str]:
        paginator = self.client.get_paginator("list_objects_v2")
        keys = []
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
            keys += [item["Key"][len(self.prefix) :] for item in page.get("Contents", [])]
        return iter(sorted(keys))

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def sha256(self, key: str) -> str:
        from botocore.exceptions import ClientError

        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
        except ClientError as err:
            if _code(err)[0] in ("NoSuchKey", "404"):
                raise ObjectNotFound(key) from None
            raise
        digest = hashlib.sha256()
        for chunk in iter(lambda: body.read(8 * _MiB), b""):
            digest.update(chunk)
        return digest.hexdigest()
