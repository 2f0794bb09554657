"""CheckpointService servicer: protobuf <-> registry translation only.

The registry is synchronous (boto3 on S3, file locks on the filesystem store): every call runs in a worker
thread so a slow store never stalls the event loop's other calls.
"""

from __future__ import annotations

import asyncio
import pathlib
import tempfile
from collections.abc import AsyncIterator

import grpc
from google.protobuf import json_format

from yieldloop.convert import head_to_pb, lora_from_pb, manifest_from_pb, manifest_to_pb, model_to_pb
from yieldloop.errors import PermissionDeniedError, invalid_field
from yieldloop.proto.checkpoint.v1 import checkpoint_service_pb2 as pb
from yieldloop.proto.checkpoint.v1 import checkpoint_service_pb2_grpc as pb_grpc
from yieldloop_server.checkpoint.importer import (
    ImportPolicy,
    UploadedFile,
    check_new_model,
    check_upload,
    import_model,
    receive_upload,
)
from yieldloop_server.checkpoint.pending import PendingHeads
from yieldloop_server.checkpoint.registry import CheckpointRegistry
from yieldloop_server.common import telemetry
from yieldloop_server.common.auth import TRUSTED, KeyStore, ModelAccess, current_principal, may
from yieldloop_server.common.grpc_server import rpc


def key_to_pb(record) -> pb.ApiKeyInfo:
    return pb.ApiKeyInfo(
        key_id=record.key_id,
        team=record.team,
        role=record.role,
        name=record.name,
        created_time=record.created_time,
        revoked_time=record.revoked_time,
    )


def _owner(requested: str, public: bool = False) -> str:
    """The owner a new model gets: the caller's team (a team may not create models for another, or public ones);
    an admin names any owner (default: its team); without auth, what was asked."""
    principal = current_principal()
    if principal is TRUSTED:
        return requested
    if not principal.is_admin:
        if requested and requested != principal.team:
            raise PermissionDeniedError(
                f"a key of team {principal.team!r} creates models for its team only, not {requested!r}",
                reason="ROLE_NOT_ALLOWED",
                field="owner",
            )
        if public:
            raise PermissionDeniedError("only admin keys make public models", reason="ROLE_NOT_ALLOWED", field="public")
    return requested or principal.team


class CheckpointServicer(pb_grpc.CheckpointServiceServicer):
    def __init__(
        self,
        registry: CheckpointRegistry,
        keys: KeyStore | None = None,
        pending: PendingHeads | None = None,
        imports: ImportPolicy = ImportPolicy(),
        max_upload_bytes: int = 500 * 10**9,
    ) -> None:
        self.registry = registry
        self.pending = pending
        self.imports = imports
        """Which server-side folders ImportModel may read (admin keys, under the operator's roots)."""
        self.max_upload_bytes = max_upload_bytes
        self.keys = keys or KeyStore(registry.store)
        # This service reads the records at the source: never a stale owner.
        self.access = ModelAccess(lambda slug: asyncio.to_thread(self.registry.get_model, slug), ttl_s=0.0)

    @rpc
    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        principal = current_principal()
        models = await asyncio.to_thread(self.registry.list_models, True)
        return pb.ListModelsResponse(models=[model_to_pb(m) for m in models if may(principal, m, "see")])

    @rpc
    async def GetModel(self, request: pb.GetModelRequest, context: grpc.aio.ServicerContext) -> pb.GetModelResponse:
        await self.access.require(request.model, "see")
        return pb.GetModelResponse(
            model=model_to_pb(await asyncio.to_thread(self.registry.describe_model, request.model))
        )

    @rpc
    async def ForkModel(self, request: pb.ForkModelRequest, context: grpc.aio.ServicerContext) -> pb.ForkModelResponse:
        lora = lora_from_pb(request.lora) if request.HasField("lora") else None
        owner = _owner(request.owner)
        await self.access.require(request.source.partition("@")[0], "see")
        info, head = await asyncio.to_thread(self.registry.fork_model, request.source, request.name, owner, lora)
        return pb.ForkModelResponse(model=model_to_pb(info), head=head_to_pb(head))

    @rpc
    async def DeleteModel(
        self, request: pb.DeleteModelRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteModelResponse:
        await self.access.require(request.model, "train")
        await asyncio.to_thread(self.registry.delete_model, request.model, request.force)
        return pb.DeleteModelResponse()

    @rpc
    async def ImportModel(
        self, request: pb.ImportModelRequest, context: grpc.aio.ServicerContext
    ) -> pb.ImportModelResponse:
        owner = _owner(request.owner, request.public)
        folder = await asyncio.to_thread(self.imports.folder, request.source, current_principal().is_admin)
        info, head = await asyncio.to_thread(
            import_model, self.registry, request.source, request.name, owner, request.public, folder
        )
        return pb.ImportModelResponse(model=model_to_pb(info), head=head_to_pb(head))

    @rpc
    async def UploadModel(
        self, request_iterator: AsyncIterator[pb.UploadModelRequest], context: grpc.aio.ServicerContext
    ) -> pb.UploadModelResponse:
        requests = aiter(request_iterator)
        first = await anext(requests, None)
        if first is None or first.WhichOneof("item") != "header":
            raise invalid_field("header", "the first message of an upload is its header")
        header = first.header
        owner = _owner(header.owner, header.public)
        files = [UploadedFile(f.name, f.size, f.sha256) for f in header.files]
        check_upload(files, self.max_upload_bytes)
        await asyncio.to_thread(check_new_model, self.registry, header.name, owner)

        async def chunks() -> AsyncIterator[bytes]:
            async for request in requests:
                if request.WhichOneof("item") != "chunk":
                    raise invalid_field("header", "an upload has one header, first")
                yield request.chunk

        source = header.source[:4096] or "upload"
        with tempfile.TemporaryDirectory(prefix="yieldloop-upload-") as staging:
            await receive_upload(files, chunks(), pathlib.Path(staging))
            info, head = await asyncio.to_thread(
                import_model, self.registry, source, header.name, owner, header.public, pathlib.Path(staging)
            )
        return pb.UploadModelResponse(model=model_to_pb(info), head=head_to_pb(head))

    @rpc
    async def CreateApiKey(
        self, request: pb.CreateApiKeyRequest, context: grpc.aio.ServicerContext
    ) -> pb.CreateApiKeyResponse:
        record, key = await asyncio.to_thread(self.keys.create, request.team, request.role, request.name)
        return pb.CreateApiKeyResponse(info=key_to_pb(record), api_key=key)

    @rpc
    async def ListApiKeys(
        self, request: pb.ListApiKeysRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListApiKeysResponse:
        return pb.ListApiKeysResponse(keys=[key_to_pb(r) for r in await asyncio.to_thread(self.keys.list)])

    @rpc
    async def RevokeApiKey(
        self, request: pb.RevokeApiKeyRequest, context: grpc.aio.ServicerContext
    ) -> pb.RevokeApiKeyResponse:
        return pb.RevokeApiKeyResponse(info=key_to_pb(await asyncio.to_thread(self.keys.revoke, request.key_id)))

    @rpc
    async def ListCheckpoints(
        self, request: pb.ListCheckpointsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListCheckpointsResponse:
        await self.access.require(request.model, "see")
        manifests, head, promotions = await asyncio.to_thread(
            lambda: (
                self.registry.list_checkpoints(request.model),
                self.registry.find_head(request.model),
                self.registry.promotions(request.model),
            )
        )
        head_id = head.checkpoint_id if head else ""
        return pb.ListCheckpointsResponse(
            checkpoints=[
                pb.CheckpointSummary(
                    checkpoint_id=m.checkpoint_id,
                    parent_checkpoint_id=m.parent_checkpoint_id,
                    step=m.step,
                    created_time=m.created_time,
                    is_head=m.checkpoint_id == head_id,
                    promotion=json_format.ParseDict(promotions.get(m.checkpoint_id, {}), pb.Promotion()),
                    pending=m.pending,
                    has_state=m.has_state,
                    metadata_json=m.metadata_json,
                )
                for m in manifests
            ]
        )

    @rpc
    async def RecordPromotion(
        self, request: pb.RecordPromotionRequest, context: grpc.aio.ServicerContext
    ) -> pb.RecordPromotionResponse:
        if request.promotion.state not in (pb.PROMOTION_STATE_PROMOTED, pb.PROMOTION_STATE_REJECTED):
            raise invalid_field("promotion.state", f"give PROMOTED (1) or REJECTED (2), not {request.promotion.state}")
        await self.access.require(request.model, "train")
        await asyncio.to_thread(
            self.registry.record_promotion,
            request.model,
            request.checkpoint_id,
            json_format.MessageToDict(request.promotion),
        )
        return pb.RecordPromotionResponse()

    @rpc
    async def GetCheckpoint(
        self, request: pb.GetCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetCheckpointResponse:
        await self.access.require(request.model, "see")
        manifest = await asyncio.to_thread(self.registry.get_manifest, request.model, request.checkpoint_id)
        return pb.GetCheckpointResponse(manifest=manifest_to_pb(manifest))

    @rpc
    async def CommitCheckpoint(
        self, request: pb.CommitCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> pb.CommitCheckpointResponse:
        await self.access.require(request.manifest.model, "train")
        attributes = {
            "yieldloop.model": request.manifest.model,
            "yieldloop.checkpoint_id": request.manifest.checkpoint_id,
            "yieldloop.pending": request.manifest.pending,
            "yieldloop.set_head": request.set_head,
        }
        with telemetry.span("checkpoint.commit", attributes):
            manifest, head = await asyncio.to_thread(
                self.registry.commit,
                manifest_from_pb(request.manifest),
                set_head=request.set_head,
                expected_head=request.expected_head_checkpoint_id,
            )
        return pb.CommitCheckpointResponse(manifest=manifest_to_pb(manifest), head=head_to_pb(head) if head else None)

    @rpc
    async def GetHead(self, request: pb.GetHeadRequest, context: grpc.aio.ServicerContext) -> pb.GetHeadResponse:
        await self.access.require(request.model, "see")
        head = await asyncio.to_thread(self.registry.get_head, request.model)
        if self.pending is not None:
            head = await self.pending.settled(head)
        return pb.GetHeadResponse(head=head_to_pb(head))

    @rpc
    async def SetHead(self, request: pb.SetHeadRequest, context: grpc.aio.ServicerContext) -> pb.SetHeadResponse:
        await self.access.require(request.model, "train")
        with telemetry.span(
            "head.move", {"yieldloop.model": request.model, "yieldloop.checkpoint_id": request.checkpoint_id}
        ):
            head = await asyncio.to_thread(
                self.registry.set_head,
                request.model,
                request.checkpoint_id,
                request.expected_checkpoint_id,
                request.expected_sequence,
            )
        return pb.SetHeadResponse(head=head_to_pb(head))

    @rpc
    async def WatchHead(
        self, request: pb.WatchHeadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchHeadResponse]:
        await self.access.require(request.model, "see")
        async for head in self.registry.watch_head(request.model, request.after_sequence):
            yield pb.WatchHeadResponse(head=head_to_pb(head))
