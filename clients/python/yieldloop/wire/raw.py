"""``client.raw.<service>``: the generated stubs on a Client's channels, for callers that need the messages
themselves (conformance tests, tools). Every call carries the client's API key."""

from __future__ import annotations

from typing import Any, Protocol

import grpc

from yieldloop.proto.checkpoint.v1 import checkpoint_service_pb2_grpc as ckpt_grpc
from yieldloop.proto.env.v1 import env_service_pb2_grpc as env_grpc
from yieldloop.proto.rollout.v1 import rollout_service_pb2_grpc as rollout_grpc
from yieldloop.proto.trainer.v1 import trainer_service_pb2_grpc as trainer_grpc
from yieldloop.wire.calls import Keyed


class Channels(Protocol):
    """What the stubs need of a client: its channels, its next EnvService target, the metadata of its key."""

    metadata: tuple[tuple[str, str], ...]

    def channel(self, service: str, address: str | None = None, connection: int = 0) -> grpc.aio.Channel: ...

    def next_env_target(self) -> tuple[str, int]: ...


class RawStubs:
    """The stubs of one client (and one API key), built once per service and channel: a stub builds a callable for
    each of its methods."""

    def __init__(self, client: Channels) -> None:
        self._client = client
        self._stubs: dict[tuple[Any, int], Any] = {}

    def _stub(self, kind: Any, channel: grpc.aio.Channel) -> Any:
        """A stub whose every call carries the API key (``authorization: Bearer``) as call metadata: gRPC's core
        sends it with the call's headers, nothing per message (an interceptor would put Python on every message
        of every stream)."""
        key = (kind, id(channel))
        stub = self._stubs.get(key)
        if stub is None:
            metadata = self._client.metadata
            stub = self._stubs[key] = Keyed(kind(channel), metadata) if metadata else kind(channel)
        return stub

    @property
    def env(self) -> env_grpc.EnvServiceStub:
        """A stub for the next EnvService replica (round robin)."""
        return self.env_at(self._client.next_env_target())

    def env_at(self, target: tuple[str, int]) -> env_grpc.EnvServiceStub:
        """A stub for one (EnvService address, connection)."""
        return self._stub(env_grpc.EnvServiceStub, self._client.channel("env", *target))

    @property
    def rollout(self) -> rollout_grpc.RolloutServiceStub:
        return self._stub(rollout_grpc.RolloutServiceStub, self._client.channel("rollout"))

    @property
    def trainer(self) -> trainer_grpc.TrainerServiceStub:
        return self._stub(trainer_grpc.TrainerServiceStub, self._client.channel("trainer"))

    @property
    def checkpoint(self) -> ckpt_grpc.CheckpointServiceStub:
        return self._stub(ckpt_grpc.CheckpointServiceStub, self._client.channel("checkpoint"))

    def clear(self) -> None:
        self._stubs.clear()
