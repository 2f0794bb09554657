"""The shape of the code: imports go one way, domain modules stay free of the wire, no import cycles."""

from __future__ import annotations

import ast
import functools
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
ROOTS = {
    "yieldloop": REPO / "clients" / "python" / "yieldloop",
    "yieldloop_server": REPO / "services" / "yieldloop_server",
}
SERVER_EDGE_PACKAGES = {"common", "hud"}
"""Packages of the server that are transport (the gRPC server, auth, telemetry) or an HTTP gateway."""
CLIENT_EDGE_PACKAGES = {"proto", "wire"}
"""Generated code, and the plumbing under the Client (calls, episode streams, raw stubs, upload streams)."""
CLIENT_EDGE_MODULES = {"client", "convert", "transport", "_status", "cli"}
"""The Client's own module (domain in, domain out: checked by signature below), the converter, the transport seam,
the error wire format, the command line."""
WIRE = ("grpc", "grpc_status", "grpc_health", "grpc_reflection", "google")


def is_domain(name: str) -> bool:
    """Domain modules go by folder: in the server, every module of a service package (checkpoint, env, rollout,
    store, trainer, weights, ...), its ``__init__`` included, but its ``server``, ``servicer`` and ``*_http`` edges
    (top-level modules are process wiring); in the client, every module outside the wire packages and the edge
    modules."""
    package, *parts = name.split(".")
    if package == "yieldloop_server":
        top_level = not parts or (len(parts) == 1 and _modules()[name].name != "__init__.py")
        if top_level or parts[0] in SERVER_EDGE_PACKAGES:
            return False
        return parts[-1] not in ("server", "servicer") and not parts[-1].endswith("_http")
    return bool(parts) and parts[0] not in CLIENT_EDGE_PACKAGES and parts[0] not in CLIENT_EDGE_MODULES


@functools.cache
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


def _imported_names(tree: ast.AST) -> set[str]:
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
            imported.update(f"{node.module}.{alias.name}" for alias in node.names)
    return imported


def test_domain_modules_import_neither_grpc_nor_generated_code() -> None:
    """Every domain module (by folder, :func:`is_domain`) speaks domain types: no grpc, no generated code, no
    converter, no wire plumbing; the Client (which returns domain types) is how it reaches another service."""
    domain = [name for name in _modules() if is_domain(name)]
    for name in domain:
        imported = _imported_names(ast.parse(_modules()[name].read_text()))
        wire = sorted(
            m
            for m in imported
            if m.split(".")[0] in WIRE
            or m.startswith(("yieldloop.proto", "yieldloop.wire", "yieldloop.convert", "yieldloop._status"))
        )
        assert not wire, f"{name} imports the wire: {wire}"
    assert "yieldloop_server.weights.group" in domain and "yieldloop.training" in domain


def _wire_names(tree: ast.Module) -> set[str]:
    """Names a module binds to generated code (``from yieldloop.proto... import x_pb2 as pb``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("yieldloop.proto"):
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.asname or alias.name for alias in node.names if alias.name.startswith("yieldloop.proto"))
    return names


def _public_signatures(tree: ast.Module) -> list[tuple[str, ast.AST]]:
    """(qualified name, annotation) of every parameter and return of public module functions and public methods
    of public classes."""
    found = []

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                args = node.args
                for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                    if arg is not None and arg.annotation is not None:
                        found.append((f"{prefix}{node.name}({arg.arg})", arg.annotation))
                if node.returns is not None:
                    found.append((f"{prefix}{node.name} ->", node.returns))

    visit(tree.body, "")
    return found


def test_no_domain_signature_carries_protobuf() -> None:
    """What domain code and the Client's callers see is domain types: no public signature of a domain module, of
    the Client or of the episode sessions it hands out names a generated message."""
    modules = _modules()
    checked = [name for name in modules if is_domain(name)] + ["yieldloop.client", "yieldloop.wire.episodes"]
    leaks = []
    for name in checked:
        tree = ast.parse(modules[name].read_text())
        wire = _wire_names(tree)
        for where, annotation in _public_signatures(tree):
            if name == "yieldloop.wire.episodes" and not where.startswith(("EpisodeSession.", "MultiplexedEpisode.")):
                continue
            if (
                where.endswith("__init__(stub)")
                or where.endswith("__init__(task)")
                or where.endswith("__init__(streams)")
            ):
                continue  # built by the Client, not by its callers
            used = {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)}
            text = ast.unparse(annotation)
            if used & wire or "_pb2" in text or "_pb." in text:
                leaks.append(f"{name}.{where} {text}")
    assert not leaks, "protobuf in domain signatures:\n" + "\n".join(leaks)


ROOM = "yieldloop_server.weights"
ROOM_DOORS = {ROOM, f"{ROOM}.base", f"{ROOM}.files"}
"""What the rest of the server may import of the weights room: the factory, the interfaces, the folder format."""


def test_weights_in_flight_live_in_one_room() -> None:
    """Every way of moving weights is in ``yieldloop_server.weights``: the rest of the server reaches it through
    the factory, the WeightSource/WeightSink interfaces and the checkpoint folder format only; process groups
    for weights (the collective transport) exist nowhere else; the room imports no service (it is below them)."""
    graph = _graph()
    for module, deps in graph.items():
        inside = module == ROOM or module.startswith(ROOM + ".")
        room_deps = {d for d in deps if d == ROOM or d.startswith(ROOM + ".")}
        if module.startswith("yieldloop_server.") and not inside:
            assert room_deps <= ROOM_DOORS, f"{module} reaches into the weights room: {sorted(room_deps - ROOM_DOORS)}"
        if inside:
            services = {
                d
                for d in deps
                if d.split(".")[1:2] and d.split(".")[1] in ("trainer", "rollout", "checkpoint", "env", "hud")
            }
            assert not services, f"{module} imports a service: {sorted(services)}"
    for module, path in _modules().items():
        if (
            module.startswith("yieldloop_server.")
            and not module.startswith(ROOM)
            and module != "yieldloop_server.trainer.distributed"
        ):
            text = path.read_text()
            assert "ProcessGroupGloo" not in text and "ProcessGroupNCCL" not in text and "TCPStore" not in text, (
                f"{module} builds process groups of its own: weights move through {ROOM}"
            )


def test_one_owner_per_stored_format() -> None:
    """Runs are recorded by RolloutService only: the trace store is built by the rollout's wiring (which writes
    and checks) and the trainer's (which reads runs named by trace id, through the RunReader port); the HUD front
    records through RolloutService's RecordRuns. The host's identity belongs to the weights room."""
    builders = sorted(
        name
        for name, path in _modules().items()
        if "TraceStore(" in path.read_text() and name != "yieldloop_server.store.traces"
    )
    assert builders == ["yieldloop_server.rollout.server", "yieldloop_server.trainer.server"], builders
    writers = sorted(
        name
        for name, path in _modules().items()
        if ".put_many(" in path.read_text()
        and not name.startswith(("yieldloop_server.rollout.", "yieldloop_server.store."))
    )
    assert not writers, f"runs written outside RolloutService: {writers}"
    holders = sorted(name for name, path in _modules().items() if "def host_id(" in path.read_text())
    assert holders == ["yieldloop_server.weights.files"], holders
