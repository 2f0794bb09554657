"""Object stores: one interface (:mod:`.base`), one module per implementation, a factory.

``open_store("/path")`` or ``open_store("file:///path")`` gives the local
filesystem store, the embedded default; ``open_store("s3://bucket/prefix")``
the S3 store (endpoint and credentials from the usual AWS configuration).
"""

from __future__ import annotations

from yieldloop_server.store.base import ObjectNotFound, ObjectStat, ObjectStore, PreconditionFailed


def open_store(url: str) -> ObjectStore:
    """Opens the object store named by ``url``: a path, ``file://path`` or ``s3://bucket[/prefix]``."""
    if url.startswith("s3://"):
        from yieldloop_server.store.s3 import S3Store

        bucket, _, prefix = url[len("s3://") :].partition("/")
        return S3Store(bucket, prefix)
    if url.startswith("file://"):
        url = url[len("file://") :]
    if "://" in url:
        raise ValueError(f"unsupported object store URL {url!r} (supported: a path, file://, s3://)")
    from yieldloop_server.store.fs import FsStore

    return FsStore(url)


__all__ = ["ObjectNotFound", "ObjectStat", "ObjectStore", "PreconditionFailed", "open_store"]
