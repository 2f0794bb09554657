"""Generates the Python protobuf modules, gRPC stubs and .pyi files from protos/.

Usage: ``python protos/generate.py [--out DIR]``. Without --out the code is
written into the import root (``clients/python/yieldloop``), where it is
checked in; tests/test_protos.py regenerates into a temporary folder and fails
on any difference.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

PROTO_ROOT = pathlib.Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
DEFAULT_OUT = REPO_ROOT / "clients" / "python"
INIT_TEXT = '"""Generated protobuf package (see protos/generate.py)."""\n'


def proto_files() -> list[pathlib.Path]:
    """All .proto files under protos/, sorted for a stable output."""
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Runs protoc into ``out_dir`` and returns the generated files (relative)."""
    from grpc_tools import protoc  # deferred: a dev-only dependency

    out_dir.mkdir(parents=True, exist_ok=True)
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    generated = []
    for rel in files:
        version_dir = out_dir / pathlib.Path(rel).parent
        # Every version folder and its service folder is a package.
        for pkg in (version_dir, version_dir.parent):
            init = pkg / "__init__.py"
            if not init.exists():
                init.write_text(INIT_TEXT)
        generated.append(version_dir / "__init__.py")
        stem = pathlib.Path(rel).stem
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            generated.append(version_dir / f"{stem}{suffix}")
    return sorted({p.relative_to(out_dir) for p in generated})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    for rel in generate(args.out):
        print(rel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
