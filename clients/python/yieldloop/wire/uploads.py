"""The UploadModel request stream of a model folder (which files go: :mod:`yieldloop.uploads`)."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

from yieldloop.proto.checkpoint.v1 import checkpoint_service_pb2 as ckpt_pb
from yieldloop.uploads import CHUNK_BYTES, model_files, sha256_of


def upload_header(
    folder: pathlib.Path, name: str, owner: str = "", public: bool = False, source: str = ""
) -> ckpt_pb.UploadModelHeader:
    """The header of an upload of ``folder`` (every file read once to hash it: call it off the event loop)."""
    return ckpt_pb.UploadModelHeader(
        name=name,
        owner=owner,
        public=public,
        source=source or str(folder),
        files=[
            ckpt_pb.UploadedFile(name=p.name, size=p.stat().st_size, sha256=sha256_of(p)) for p in model_files(folder)
        ],
    )


def upload_requests(folder: pathlib.Path, header: ckpt_pb.UploadModelHeader) -> Iterator[ckpt_pb.UploadModelRequest]:
    """The UploadModel stream: the header, then each of its files' chunks."""
    yield ckpt_pb.UploadModelRequest(header=header)
    for path in (folder / f.name for f in header.files):
        with path.open("rb") as f:
            for block in iter(lambda: f.read(CHUNK_BYTES), b""):
                yield ckpt_pb.UploadModelRequest(chunk=block)
