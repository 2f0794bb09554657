"""The checked-in generated code matches the protos, and the protos follow the conventions."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PROTOS = REPO / "protos"


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", PROTOS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_up_to_date(tmp_path: pathlib.Path) -> None:
    generated = _load_generator().generate(tmp_path)
    assert len(generated) >= 5 * 4
    stale = [
        str(rel)
        for rel in generated
        if (tmp_path / rel).read_bytes() != (REPO / "clients" / "python" / rel).read_bytes()
    ]
    assert not stale, f"run `python protos/generate.py`: stale generated files {stale}"


@pytest.mark.parametrize("proto", sorted(PROTOS.rglob("*_service.proto")), ids=lambda p: p.parent.parent.name)
def test_service_conventions(proto: pathlib.Path) -> None:
    text = proto.read_text()
    service = proto.parent.parent.name
    package = re.search(r"^package ([\w.]+);", text, re.M).group(1)
    assert package == f"yieldloop.{service}.v1", "package must match the folder"
    rpcs = re.findall(r"((?:\s*//[^\n]*\n)+)\s*rpc (\w+)\((?:stream )?(\w+)\) returns \((?:stream )?(\w+)\)", text)
    assert rpcs, "no rpcs found"
    for comment, name, request, response in rpcs:
        assert request == f"{name}Request", f"{name} must take its own {name}Request"
        assert response == f"{name}Response", f"{name} must return its own {name}Response"
        assert "Returns:" in comment, f"{name}'s comment must list its status codes"
    assert len(rpcs) == text.count(" rpc "), "every rpc needs a comment"


@pytest.mark.parametrize("proto", sorted(PROTOS.rglob("*.proto")), ids=lambda p: p.name)
def test_enums_start_unspecified(proto: pathlib.Path) -> None:
    for name, body in re.findall(r"enum (\w+) \{(.*?)\}", proto.read_text(), re.S):
        first = re.search(r"(\w+) = (\d+);", body)
        prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()
        assert first.group(1) == f"{prefix}_UNSPECIFIED" and first.group(2) == "0", name


def test_cli_and_import_stay_light() -> None:
    import subprocess

    code = (
        "import sys, yieldloop, yieldloop.cli; "
        "print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    help_text = subprocess.run(
        [sys.executable, "-m", "yieldloop.cli", "--help"], capture_output=True, text=True, check=True
    )
    assert "demo" in help_text.stdout and "serve" in help_text.stdout


@pytest.mark.parametrize(
    "root,source,package",
    [
        (REPO / "clients" / "python", REPO / "clients" / "python" / "yieldloop", "yieldloop"),
        (REPO, REPO / "services" / "yieldloop_server", "yieldloop_server"),
    ],
    ids=["client", "server"],
)
def test_every_package_is_in_the_distribution(tmp_path: pathlib.Path, root, source, package) -> None:
    """Packages are discovered, never listed: every folder with an __init__.py lands in the built wheel."""
    import shutil
    import subprocess
    import zipfile

    had_build = (root / "build").exists()
    try:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "-q",
                "-w",
                str(tmp_path),
                str(root),
            ],
            check=True,
            capture_output=True,
        )
    finally:
        if not had_build:  # setuptools stages the wheel in the source tree
            shutil.rmtree(root / "build", ignore_errors=True)
    [wheel] = tmp_path.glob("*.whl")
    shipped = {name for name in zipfile.ZipFile(wheel).namelist() if name.endswith(".py")}
    expected = {
        "/".join((package, *init.relative_to(source).parts))
        for init in source.rglob("*.py")
        if "__pycache__" not in init.parts
    }
    assert expected <= shipped, f"left out of the wheel: {sorted(expected - shipped)}"


def test_every_error_reason_is_on_the_wire_contract() -> None:
    """Reasons are ErrorReason names, so clients in other languages see the whole list."""
    from yieldloop.proto.common.v1 import common_pb2

    known = set(common_pb2.ErrorReason.keys())
    used = set()
    for source in [
        *(REPO / "clients" / "python" / "yieldloop").rglob("*.py"),
        *(REPO / "services" / "yieldloop_server").rglob("*.py"),
    ]:
        if "proto" in source.relative_to(REPO).parts[:4]:
            continue
        text = source.read_text()
        used |= set(re.findall(r'reason="([A-Z_]+)"', text))
        used |= set(re.findall(r'^\w+_ERROR = "([A-Z_]+)"', text, re.M))  # a module's named reason
    assert used and used <= known, f"reasons missing from common.proto's ErrorReason: {sorted(used - known)}"
