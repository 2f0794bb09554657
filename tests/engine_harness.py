"""One engine of each kind per test session, loaded with the tiny model, and served over gRPC.

Shared by the engine test suite and the agent-loop tests. vLLM starts once per
session (its engine core is a child process); the suite skips the vLLM half
where vLLM is not installed.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil

from yieldloop.client import Client
from yieldloop_server.common.grpc_server import GrpcServer
from yieldloop_server.rollout.engines import Engine, create_engine
from yieldloop_server.rollout.server import serve_engine as serve_engine_grpc


def perturbed_copy(folder: pathlib.Path, out: pathlib.Path, scale: float = 0.05, seed: int = 1) -> pathlib.Path:
    """A second checkpoint of the same model: every weight moved by noise (what a training step does)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    model.save_pretrained(out, safe_serialization=True)
    for path in folder.iterdir():
        if path.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(path, out / path.name)
    return out


@dataclasses.dataclass
class ServedEngine:
    kind: str
    engine: Engine
    folders: dict[str, pathlib.Path]
    """Checkpoint id -> HF folder ("v1" is loaded at start, "v2" is a perturbed copy)."""
    server: GrpcServer
    client: Client


async def serve_engine(kind: str, folders: dict[str, pathlib.Path], model: str = "tiny") -> ServedEngine:
    engine = create_engine(kind.removesuffix("-process"), process=kind.endswith("-process"))
    await engine.load_weights(folders["v1"], "v1")
    server = await serve_engine_grpc(model, engine)
    return ServedEngine(kind, engine, folders, server, Client(rollout=server.address, timeout=120))


async def stop_engine(served: ServedEngine) -> None:
    await served.client.close()
    await served.server.stop(1.0)
    await served.engine.close()
