"""The shape of the code: imports go one way, domain modules stay free of the wire, no import cycles."""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
ROOTS = {
    "yieldloop": REPO / "clients" / "python" / "yieldloop",
    "yieldloop_server": REPO / "services" / "yieldloop_server",
}
DOMAIN_MODULES = [
    "yieldloop_server.trainer.trainer",
    "yieldloop_server.trainer.losses",
    "yieldloop_server.trainer.session",
    "yieldloop_server.checkpoint.registry",
    "yieldloop_server.checkpoint.files",
    "yieldloop_server.rollout.rollouts",
    "yieldloop_server.rollout.agent",
    "yieldloop_server.rollout.weights",
    "yieldloop_server.store.base",
    "yieldloop_server.store.fs",
    "yieldloop_server.store.s3",
    "yieldloop_server.store.traces",
    "yieldloop.groups",
    "yieldloop.types",
    "yieldloop.environment",
    "yieldloop.episode",
]


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for package, root in ROOTS.items():
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if parts and parts[0] == "proto":
                continue  # generated code
            name = ".".join((package, *parts)).removesuffix(".__init__")
            modules[name] = path
    return modules


def _imports(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """Every module of ours that ``path`` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def test_no_import_cycles() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    # Package __init__ modules that only re-export their submodules are not cycles of logic.
    cycles = [c for c in cycles if not any(m in graph and all(n.startswith(m + ".") or n == m for n in c) for m in c)]
    assert not cycles, f"import cycles: {cycles}"


def test_imports_go_one_way() -> None:
    graph = _graph()
    client_to_server = {
        m: sorted(i for i in deps if i.startswith("yieldloop_server"))
        for m, deps in graph.items()
        if m.startswith("yieldloop.")
    }
    assert not {m: d for m, d in client_to_server.items() if d}, "the client distribution imports the server"
    servicers = {m for m in graph if m.endswith(".servicer")}
    for module, deps in graph.items():
        if not module.startswith("yieldloop_server."):
            continue
        service = module.split(".")[1]
        foreign = [d for d in deps & servicers if d.split(".")[1] != service]
        assert not foreign, f"{module} imports another service's servicer: {foreign}"


def test_domain_modules_import_neither_grpc_nor_generated_code() -> None:
    modules = _modules()
    for name in DOMAIN_MODULES:
        tree = ast.parse(modules[name].read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        wire = sorted(
            m
            for m in imported
            if m.split(".")[0] in ("grpc", "grpc_status", "google")
            or m.startswith("yieldloop.proto")
            or m in ("yieldloop.convert", "yieldloop.client")
        )
        allowed = (
            {"yieldloop.client"}
            if name
            in (
                "yieldloop_server.rollout.rollouts",
                "yieldloop_server.rollout.weights",
                "yieldloop_server.trainer.session",
            )
            else set()
        )
        assert not set(wire) - allowed, f"{name} imports the wire: {wire}"
