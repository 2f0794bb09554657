"""Parts every service process shares: the gRPC server shell, error translation, logging."""

from __future__ import annotations

import os
import pathlib


def write_file_atomically(path: pathlib.Path, text: str, mode: int = 0o644) -> None:
    """Writes ``text`` to ``path`` so that a reader sees either the previous file or the whole new one (a file of
    its own, created with ``mode``, renamed over ``path``)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as file:
        file.write(text)
    os.replace(tmp, path)
