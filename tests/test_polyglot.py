"""The protos as the product's public contract: buf's lint, format and breaking checks, and the clients generated
from them in other languages (TypeScript, Go) against a live stack.

The tools are installed by ``.ci/run`` (``npm install`` in clients/typescript; Debian's Go packages). Elsewhere a test
whose tool is missing is skipped, saying what to install, unless $YIELDLOOP_REQUIRE_POLYGLOT names its kind
(``.ci/run`` names what it installed): then it fails.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
TS = REPO / "clients" / "typescript"
BUF = TS / "node_modules" / ".bin" / "buf"
RELEASED = REPO / "protos" / "released" / "v0.1.0.binpb"
"""The last released state of the protos: buf breaking checks the protos against it."""


def require(tool: pathlib.Path | str | None, install: str, kind: str) -> None:
    """Skips when ``tool`` is missing, saying how to install it; fails instead when ``kind`` (buf, typescript,
    go) is in $YIELDLOOP_REQUIRE_POLYGLOT (``.ci/run`` lists what it installed)."""
    if tool and (pathlib.Path(tool).exists() if isinstance(tool, pathlib.Path) else shutil.which(tool)):
        return
    if kind in os.environ.get("YIELDLOOP_REQUIRE_POLYGLOT", "").split(","):
        pytest.fail(f"{tool} is missing: {install}")
    pytest.skip(f"{tool} is missing: {install}")


def buf(*args: str, cwd: pathlib.Path = REPO) -> subprocess.CompletedProcess:
    require(BUF, "npm install --prefix clients/typescript", "buf")
    return subprocess.run([str(BUF), *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_buf_lint_and_format() -> None:
    """STANDARD lint (ErrorReason's values are the wire's reason strings: the one exception, in buf.yaml) and
    buf's formatting."""
    lint = buf("lint")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    formatted = buf("format", "--diff", "--exit-code")
    assert formatted.returncode == 0, "run `buf format -w`:\n" + formatted.stdout + formatted.stderr


def test_protos_keep_the_released_contract() -> None:
    breaking = buf("breaking", "--against", str(RELEASED))
    assert breaking.returncode == 0, breaking.stdout + breaking.stderr


def test_a_removed_field_fails_the_breaking_check(tmp_path: pathlib.Path) -> None:
    """A planted breaking change, on a scratch copy of the protos: removing a field is caught."""
    shutil.copytree(REPO / "protos", tmp_path / "protos")
    shutil.copy(REPO / "buf.yaml", tmp_path / "buf.yaml")
    proto = tmp_path / "protos" / "yieldloop" / "rollout" / "v1" / "rollout_service.proto"
    text = proto.read_text()
    assert "  string openai_base_url = 6;\n" in text
    proto.write_text(text.replace("  string openai_base_url = 6;\n", ""))
    breaking = buf("breaking", "--against", str(RELEASED), cwd=tmp_path)
    assert breaking.returncode != 0
    assert "openai_base_url" in breaking.stdout + breaking.stderr and "deleted" in breaking.stdout + breaking.stderr


def test_typescript_code_is_generated_from_the_protos(tmp_path: pathlib.Path) -> None:
    require(BUF, "npm install --prefix clients/typescript", "typescript")
    fresh = tmp_path / "gen"
    made = subprocess.run(
        [str(TS / "generate.sh"), str(fresh)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert made.returncode == 0, made.stderr
    checked_in = {p.relative_to(TS / "gen"): p.read_text() for p in (TS / "gen").rglob("*.ts")}
    assert checked_in == {p.relative_to(fresh): p.read_text() for p in fresh.rglob("*.ts")}, (
        "clients/typescript/gen is stale: run clients/typescript/generate.sh"
    )


@pytest.fixture(scope="module")
def stack() -> Iterator[pathlib.Path]:
    """One `yieldloop up --tls` (auth on) that the TypeScript and Go tests and this module's checks share."""
    import tempfile

    from up_harness import start_up, stop_up

    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="yieldloop-polyglot-"))
    process = start_up(data_dir, "--tls", "--no-hud", ready=lambda d: len(list((d / "run").glob("*.json"))) >= 4)
    yield data_dir
    stop_up(process)
    shutil.rmtree(data_dir, ignore_errors=True)


def _on(stack: pathlib.Path) -> dict[str, str]:
    """The environment of a client that attaches to ``stack`` (and finds `yieldloop` on PATH)."""
    return {
        **os.environ,
        "YIELDLOOP_DATA_DIR": str(stack),
        "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }


async def _head(stack: pathlib.Path, model: str) -> str:
    from yieldloop.training import connect

    async with connect(stack) as client:
        return (await client.get_head(model)).checkpoint_id


def test_typescript_client_against_a_live_stack(stack: pathlib.Path) -> None:
    """`npm test`: node's test runner drives the stack (list, fork, Generate, a bidi episode, StreamRollouts,
    ForwardBackward + OptimStep seen by WatchHead, typed errors, auth); the Python client sees what it did."""
    import asyncio

    require(TS / "node_modules" / ".bin" / "tsc", "npm install --prefix clients/typescript", "typescript")
    done = subprocess.run(
        ["npm", "test", "--silent"], cwd=TS, capture_output=True, text=True, timeout=900, env=_on(stack)
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert "# fail 0" in done.stdout, done.stdout[-3000:]
    assert asyncio.run(_head(stack, "ts-fork")).startswith("step-000001-")


GO = REPO / "clients" / "go"
GO_PACKAGES = (
    "apt-get install golang-go protoc-gen-go protoc-gen-go-grpc golang-google-grpc-dev "
    "golang-google-protobuf-dev golang-github-golang-protobuf-1-5-dev"
)


def test_go_code_is_generated_from_the_protos(tmp_path: pathlib.Path) -> None:
    require(BUF, "npm install --prefix clients/typescript", "go")
    require("protoc-gen-go-grpc", GO_PACKAGES, "go")
    made = subprocess.run([str(GO / "generate.sh"), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    checked_in = {p.relative_to(GO / "gen"): p.read_text() for p in (GO / "gen").rglob("*.go")}
    assert checked_in == {p.relative_to(tmp_path / "gen"): p.read_text() for p in (tmp_path / "gen").rglob("*.go")}, (
        "clients/go/gen is stale: run clients/go/generate.sh"
    )


def test_go_client_against_a_live_stack(stack: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """`go test` (GOPATH mode, Debian's packages, no module proxy) against the stack: list, Generate, a head moved
    by a training step, error reasons, a call without a key refused; the Python client sees the head it moved."""
    import asyncio

    require("go", GO_PACKAGES, "go")
    gopath = tmp_path / "gopath"
    (gopath / "src" / "yieldloop.dev").mkdir(parents=True)
    (gopath / "src" / "yieldloop.dev" / "client").symlink_to(GO)
    env = {
        **_on(stack),
        "GOPATH": f"{gopath}{os.pathsep}/usr/share/gocode",
        "GO111MODULE": "off",
        "GOPROXY": "off",
        "GOFLAGS": "",
        "GOCACHE": str(tmp_path / "gocache"),
    }
    vetted = subprocess.run(
        ["go", "vet", "yieldloop.dev/client/yieldloop"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert vetted.returncode == 0, vetted.stdout + vetted.stderr
    tested = subprocess.run(
        ["go", "test", "-count=1", "yieldloop.dev/client/yieldloop"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert tested.returncode == 0, tested.stdout[-6000:] + tested.stderr[-3000:]
    assert "ok  \tyieldloop.dev/client/yieldloop" in tested.stdout
    assert asyncio.run(_head(stack, "go-fork")).startswith("step-000001-")
