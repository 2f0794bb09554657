"""Object stores: one interface (:mod:`.base`), one module per implementation, a factory.

``open_store("/path")`` or ``open_store("file:///path")`` gives the local
filesystem store, the embedded default.
"""

from __future__ import annotations

from yieldloop.services.store.base import ObjectNotFound, ObjectStat, ObjectStore, PreconditionFailed


def open_store(url: str) -> ObjectStore:
    """Opens the object store named by ``url`` (a path or ``file://`` URL)."""
    if url.startswith("file://"):
        url = url[len("file://"):]
    if "://" in url:
        raise ValueError(f"unsupported object store URL {url!r} (supported: a path or file://)")
    from yieldloop.services.store.fs import FsStore

    return FsStore(url)


__all__ = ["ObjectNotFound", "ObjectStat", "ObjectStore", "PreconditionFailed", "open_store"]
