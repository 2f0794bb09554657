"""Generates the Python protobuf modules, gRPC stubs and .pyi files from protos/.

Usage: ``python protos/generate.py [--out DIR]``. Without --out the code is
written into the client distribution (``clients/python``), where it is checked
in; tests/test_protos.py regenerates into a temporary folder and fails on any
difference.

Generated code lives apart from the hand-written modules, under
``yieldloop.proto`` (``yieldloop/proto/<service>/v1/``). The wire names do not
change (``yieldloop.env.v1.EnvService``): protoc writes the modules where the
proto paths say (``yieldloop/env/v1``), and they are moved under ``proto/``
with their imports of each other rewritten, as temporalio's gen_protos does.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import tempfile

PROTO_ROOT = pathlib.Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
DEFAULT_OUT = REPO_ROOT / "clients" / "python"
GENERATED_PACKAGE = "yieldloop.proto"
INIT_TEXT = '"""Generated protobuf package (see protos/generate.py)."""\n'
# Module paths protoc derives from proto paths: "from yieldloop.common.v1 import common_pb2" and the
# builder's module name 'yieldloop.env.v1.env_service_pb2'.
_OWN_MODULE = re.compile(r"\byieldloop\.(\w+)\.v1\b(?=( import |\.\w+_pb2'))")


def proto_files() -> list[pathlib.Path]:
    """All .proto files under protos/, sorted for a stable output."""
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Runs protoc and writes the code under ``out_dir/yieldloop/proto``; returns the files (relative to out_dir)."""
    from grpc_tools import protoc  # deferred: a dev-only dependency

    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    target_root = out_dir / pathlib.Path(*GENERATED_PACKAGE.split("."))
    generated = []
    with tempfile.TemporaryDirectory() as staging:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={staging}",
            f"--pyi_out={staging}",
            f"--grpc_python_out={staging}",
            *files,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        for rel in map(pathlib.Path, files):
            version_dir = target_root / rel.parent.relative_to("yieldloop")  # yieldloop/proto/<service>/v1
            version_dir.mkdir(parents=True, exist_ok=True)
            for pkg in (version_dir, version_dir.parent, target_root):
                init = pkg / "__init__.py"
                if not init.exists():
                    init.write_text(INIT_TEXT)
                generated.append(init)
            for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
                source = pathlib.Path(staging) / rel.parent / f"{rel.stem}{suffix}"
                text = _OWN_MODULE.sub(lambda m: f"{GENERATED_PACKAGE}.{m.group(1)}.v1", source.read_text())
                (version_dir / source.name).write_text(text)
                generated.append(version_dir / source.name)
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
