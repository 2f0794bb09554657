"""Benchmarks' scratch folders: made fresh under the temp folder and removed when the benchmark's process ends.

Their stores hold every step's weights and runs (125 MB for a short loopbench run, gigabytes for syncbench's
~100 MB model): left behind, a few runs a day fill a disk. ``YIELDLOOP_KEEP_SCRATCH=1`` keeps them (to look at
the services' logs or the recorded runs afterwards); the path is printed on stderr either way.
"""

from __future__ import annotations

import atexit
import os
import pathlib
import shutil
import sys
import tempfile


def scratch_dir(prefix: str) -> pathlib.Path:
    """A new folder named ``<prefix><random>`` in the temp folder, removed at exit unless YIELDLOOP_KEEP_SCRATCH
    is set (by this process only: a child that inherits the handler leaves it)."""
    path = pathlib.Path(tempfile.mkdtemp(prefix=prefix))
    keep = os.environ.get("YIELDLOOP_KEEP_SCRATCH", "") not in ("", "0")
    print(
        f"scratch folder {path} ({'kept' if keep else 'removed at exit; YIELDLOOP_KEEP_SCRATCH=1 keeps it'})",
        file=sys.stderr,
    )
    if not keep:
        owner = os.getpid()
        atexit.register(lambda: os.getpid() == owner and shutil.rmtree(path, ignore_errors=True))
    return path
