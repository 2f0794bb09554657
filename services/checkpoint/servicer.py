"""CheckpointService servicer: protobuf <-> registry translation only."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import grpc
from google.protobuf import json_format

from yieldloop.checkpoint.v1 import checkpoint_service_pb2 as pb
from yieldloop.checkpoint.v1 import checkpoint_service_pb2_grpc as pb_grpc
from yieldloop.errors import invalid_field
from yieldloop.services.checkpoint.registry import CheckpointRegistry, Head, Manifest, ModelInfo, ObjectInfo
from yieldloop.services.common.grpc_server import rpc


def head_pb(head: Head) -> pb.Head:
    return pb.Head(**dataclasses.asdict(head))


def model_pb(info: ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(**dataclasses.asdict(info))


def manifest_pb(manifest: Manifest) -> pb.Manifest:
    return pb.Manifest(**dataclasses.asdict(manifest))


def manifest_from_pb(message: pb.Manifest) -> Manifest:
    return Manifest(
        model=message.model,
        checkpoint_id=message.checkpoint_id,
        objects=[ObjectInfo(o.name, o.size, o.sha256, o.key) for o in message.objects],
        parent_checkpoint_id=message.parent_checkpoint_id,
        step=message.step,
        created_time=message.created_time,
        metadata_json=message.metadata_json,
    )


class CheckpointServicer(pb_grpc.CheckpointServiceServicer):
    def __init__(self, registry: CheckpointRegistry) -> None:
        self.registry = registry

    @rpc
    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[model_pb(m) for m in self.registry.list_models()])

    @rpc
    async def ForkModel(self, request: pb.ForkModelRequest, context: grpc.aio.ServicerContext) -> pb.ForkModelResponse:
        info, head = self.registry.fork_model(request.source, request.name, request.owner)
        return pb.ForkModelResponse(model=model_pb(info), head=head_pb(head))

    @rpc
    async def ListCheckpoints(
        self, request: pb.ListCheckpointsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListCheckpointsResponse:
        manifests = self.registry.list_checkpoints(request.model)
        head = self.registry.find_head(request.model)
        head_id = head.checkpoint_id if head else ""
        promotions = self.registry.promotions(request.model)
        return pb.ListCheckpointsResponse(
            checkpoints=[
                pb.CheckpointSummary(
                    checkpoint_id=m.checkpoint_id,
                    parent_checkpoint_id=m.parent_checkpoint_id,
                    step=m.step,
                    created_time=m.created_time,
                    is_head=m.checkpoint_id == head_id,
                    promotion=json_format.ParseDict(promotions.get(m.checkpoint_id, {}), pb.Promotion()),
                )
                for m in manifests
            ]
        )

    @rpc
    async def RecordPromotion(
        self, request: pb.RecordPromotionRequest, context: grpc.aio.ServicerContext
    ) -> pb.RecordPromotionResponse:
        if request.promotion.state == pb.PROMOTION_STATE_UNSPECIFIED:
            raise invalid_field("promotion.state", "give PROMOTED or REJECTED")
        self.registry.record_promotion(
            request.model, request.checkpoint_id, json_format.MessageToDict(request.promotion)
        )
        return pb.RecordPromotionResponse()

    @rpc
    async def GetCheckpoint(
        self, request: pb.GetCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetCheckpointResponse:
        return pb.GetCheckpointResponse(manifest=manifest_pb(self.registry.get_manifest(request.model, request.checkpoint_id)))

    @rpc
    async def CommitCheckpoint(
        self, request: pb.CommitCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> pb.CommitCheckpointResponse:
        # Checksumming large objects blocks: keep it off the event loop.
        manifest, head = await asyncio.to_thread(
            self.registry.commit,
            manifest_from_pb(request.manifest),
            set_head=request.set_head,
            expected_head=request.expected_head_checkpoint_id,
        )
        return pb.CommitCheckpointResponse(manifest=manifest_pb(manifest), head=head_pb(head) if head else None)

    @rpc
    async def GetHead(self, request: pb.GetHeadRequest, context: grpc.aio.ServicerContext) -> pb.GetHeadResponse:
        return pb.GetHeadResponse(head=head_pb(self.registry.get_head(request.model)))

    @rpc
    async def SetHead(self, request: pb.SetHeadRequest, context: grpc.aio.ServicerContext) -> pb.SetHeadResponse:
        head = self.registry.set_head(
            request.model, request.checkpoint_id, request.expected_checkpoint_id, request.expected_sequence
        )
        return pb.SetHeadResponse(head=head_pb(head))

    @rpc
    async def WatchHead(
        self, request: pb.WatchHeadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchHeadResponse]:
        async for head in self.registry.watch_head(request.model, request.after_sequence):
            yield pb.WatchHeadResponse(head=head_pb(head))
