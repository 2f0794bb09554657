"""Local filesystem object store: the embedded default.

Writes go to a temporary file in the target folder, are fsynced and renamed
into place, then the folder is fsynced (new folders in their parents too), so a
crash never leaves a half-written object and a machine crash never loses one
that was acknowledged. Conditional puts
hold an exclusive ``flock`` on a per-key lock file, so they are atomic across
processes on one machine. A file its producer will never write again (a trainer's
checkpoint) is adopted: hard-linked into place and synced, not copied.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import pathlib
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

from yieldloop_server.store.base import (
    ObjectNotFound,
    ObjectStat,
    ObjectStore,
    PreconditionFailed,
    check_key,
    hash_file,
    sha256_file,
)

_LOCKS = ".locks"


def _fsync_dir(folder: pathlib.Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dirs(folder: pathlib.Path) -> None:
    """``mkdir -p``, each new directory's entry synced in its parent (a written object's path survives a crash)."""
    missing = []
    while not folder.is_dir():
        missing.append(folder)
        folder = folder.parent
    for new in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by another writer
            new.mkdir()
        _fsync_dir(new.parent)


class FsStore(ObjectStore):
    """Objects as files under ``root``; ETag is the MD5 of the content (as S3's for simple puts)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = pathlib.Path(root).resolve()
        (self.root / _LOCKS).mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"FsStore({str(self.root)!r})"

    def _path(self, key: str) -> pathlib.Path:
        return self.root / check_key(key)

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        lock_path = self.root / _LOCKS / hashlib.sha256(key.encode()).hexdigest()
        with lock_path.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _write_atomic(self, path: pathlib.Path, write: callable) -> None:
        _make_dirs(path.parent)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        _fsync_dir(path.parent)  # the rename itself survives a machine crash only once its directory is synced

    def put_bytes(self, key: str, data: bytes, *, if_match: str | None = None, if_none_match: bool = False) -> str:
        path = self._path(key)
        if if_match is None and not if_none_match:
            self._write_atomic(path, lambda f: f.write(data))
            return hashlib.md5(data).hexdigest()
        with self._locked(key):
            current = self.stat(key)
            if if_none_match and current is not None:
                raise PreconditionFailed(f"{key} exists")
            if if_match is not None and (current is None or current.etag != if_match):
                raise PreconditionFailed(f"{key} changed (expected etag {if_match})")
            self._write_atomic(path, lambda f: f.write(data))
        return hashlib.md5(data).hexdigest()

    def get_bytes(self, key: str) -> tuple[bytes, str]:
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectNotFound(key) from None
        return data, hashlib.md5(data).hexdigest()

    def put_file(self, key: str, path: pathlib.Path) -> str:
        digest = hashlib.md5()

        def copy(dst: Any) -> None:  # one pass: the ETag is computed while copying
            with open(path, "rb") as src:
                for chunk in iter(lambda: src.read(1 << 22), b""):
                    digest.update(chunk)
                    dst.write(chunk)

        self._write_atomic(self._path(key), copy)
        return digest.hexdigest()

    def adopt_file(self, key: str, path: pathlib.Path) -> None:
        target = self._path(key)
        _make_dirs(target.parent)
        link = target.parent / f".tmp-{uuid.uuid4().hex}"
        try:
            os.link(path, link)
        except OSError:  # another filesystem, or links not allowed here
            self.put_file(key, path)
            return
        try:
            fd = os.open(link, os.O_RDONLY)
            try:
                os.fsync(fd)  # its bytes (written by its producer, maybe not synced yet)
            finally:
                os.close(fd)
            os.replace(link, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(link)
            raise
        _fsync_dir(target.parent)

    def get_file(self, key: str, path: pathlib.Path) -> None:
        source = self._path(key)
        if not source.is_file():
            raise ObjectNotFound(key)
        with source.open("rb") as src:
            self._write_atomic(pathlib.Path(path), lambda f: shutil.copyfileobj(src, f, 1 << 20))

    def local_file(self, key: str) -> pathlib.Path | None:
        path = self._path(key)
        return path if path.is_file() else None

    def size(self, key: str) -> int | None:
        path = self._path(key)
        return path.stat().st_size if path.is_file() else None

    def modified(self, key: str) -> float | None:
        path = self._path(key)
        return path.stat().st_mtime if path.is_file() else None

    def stat(self, key: str) -> ObjectStat | None:
        path = self._path(key)
        if not path.is_file():
            return None
        info = path.stat()
        return ObjectStat(key=key, size=info.st_size, etag=hash_file(path, "md5"), modified=info.st_mtime)

    def list(self, prefix: str) -> Iterator[str]:
        base = self.root / prefix.rstrip("/") if prefix else self.root
        if not base.is_dir():
            return iter(())
        keys = (
            str(p.relative_to(self.root))
            for p in base.rglob("*")
            if p.is_file() and not p.name.startswith(".tmp-") and _LOCKS not in p.relative_to(self.root).parts
        )
        return iter(sorted(keys))

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    def sha256(self, key: str) -> str:
        path = self._path(key)
        if not path.is_file():
            raise ObjectNotFound(key)
        return sha256_file(path)
