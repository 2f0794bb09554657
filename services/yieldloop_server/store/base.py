"""The ObjectStore interface: keys, bytes, ETags and conditional puts.

Keys are ``/``-separated relative paths (``models/tiny/HEAD``). Conditional
puts give compare-and-swap: ``if_none_match=True`` creates only if absent,
``if_match=etag`` replaces only the version that was read.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import pathlib
import re
from collections.abc import Iterator

from yieldloop.errors import invalid_field

_KEY_PART = re.compile(r"^[A-Za-z0-9._=+-]+$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class ObjectNotFound(KeyError):
    """No object at the key."""


class PreconditionFailed(Exception):
    """A conditional put found another version (or an existing object)."""


@dataclasses.dataclass(frozen=True)
class ObjectStat:
    key: str
    size: int
    etag: str
    modified: float = 0.0
    """Last-modified time, Unix seconds."""


def check_name(value: str, field: str) -> str:
    """Validates a name used as one key part (model slug, checkpoint id, trace id): no separators,
    no ``..``, 1-128 characters; INVALID_ARGUMENT naming ``field`` otherwise."""
    if not isinstance(value, str) or not _NAME.fullmatch(value) or ".." in value:
        raise invalid_field(field, f"{field} {value!r:.80} must match {_NAME.pattern} and not contain '..'")
    return value


def check_key(key: str) -> str:
    """Validates an object key: relative, no empty, ``.`` or ``..`` parts."""
    parts = key.split("/")
    if not key or any(p in ("", ".", "..") or not _KEY_PART.fullmatch(p) for p in parts):
        raise ValueError(f"invalid object key {key!r}")
    return key


def hash_file(path: pathlib.Path, algorithm: str = "sha256") -> str:
    """Hex digest of a file, read in 1 MiB chunks."""
    digest = hashlib.new(algorithm)
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_file(path: pathlib.Path) -> str:
    return hash_file(path, "sha256")


class ObjectStore(abc.ABC):
    """Blob storage with conditional writes (filesystem or S3)."""

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes, *, if_match: str | None = None, if_none_match: bool = False) -> str:
        """Writes ``data`` atomically; returns the new ETag.

        Raises:
            PreconditionFailed: ``if_match`` differs from the current ETag, or
                ``if_none_match`` and the object exists.
        """

    @abc.abstractmethod
    def get_bytes(self, key: str) -> tuple[bytes, str]:
        """Returns the object's bytes and ETag. Raises ObjectNotFound."""

    @abc.abstractmethod
    def put_file(self, key: str, path: pathlib.Path) -> str:
        """Uploads a local file atomically; returns the ETag."""

    def adopt_file(self, key: str, path: pathlib.Path) -> None:
        """Stores a local file nobody will write to again (its producer may still read or delete it): a store on
        the same filesystem keeps the file itself (a hard link, synced: no copy), any other uploads it."""
        self.put_file(key, path)

    @abc.abstractmethod
    def get_file(self, key: str, path: pathlib.Path) -> None:
        """Downloads an object to ``path`` (written atomically). Raises ObjectNotFound."""

    @abc.abstractmethod
    def stat(self, key: str) -> ObjectStat | None:
        """Size and ETag of an object, or None when absent."""

    def local_file(self, key: str) -> pathlib.Path | None:
        """The file holding an object on this machine, for readers that only read it (a hard link to it is a copy
        that costs nothing: objects are never changed in place, every write is a new file); None when the store
        has none (S3) or the object is absent."""
        return None

    def size(self, key: str) -> int | None:
        """Size of an object, or None when absent (implementations avoid reading it)."""
        stat = self.stat(key)
        return None if stat is None else stat.size

    def modified(self, key: str) -> float | None:
        """Last-modified time (Unix seconds) of an object, or None when absent (without reading it)."""
        stat = self.stat(key)
        return None if stat is None else stat.modified

    @abc.abstractmethod
    def list(self, prefix: str) -> Iterator[str]:
        """Keys under ``prefix`` (a folder-like prefix ending in ``/``), sorted."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Removes an object (absent is fine)."""

    def sha256(self, key: str) -> str:
        """SHA-256 of an object's bytes (implementations may stream)."""
        data, _ = self.get_bytes(key)
        return hashlib.sha256(data).hexdigest()
