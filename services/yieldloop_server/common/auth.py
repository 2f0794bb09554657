"""API keys, the principal behind each call, and who may do what: one layer for every service.

- A key (``yl_<key id>_<secret>``) identifies a principal: a team and a role. Roles nest: ``sample`` (roll out
  and sample the team's models and public ones) < ``train`` (also fork, import, train and move the head of the
  team's models) < ``admin`` (manage keys, any model). The services call each other with a ``service`` key,
  admin's equal. Keys are stored hashed in the object store (``auth/keys/<key id>.json``: team, role, the
  secret's sha256), so every service of a stack checks them against the same records.
- :class:`Authenticator` is a transport :class:`~yieldloop.transport.ServerInterceptor`: every gRPC call and
  every HTTP request but health and reflection must carry a key (``authorization: Bearer <key>`` or
  ``x-api-key``); missing or unknown: UNAUTHENTICATED; a role below what the method needs (:data:`METHOD_ROLES`):
  PERMISSION_DENIED. The caller's :class:`Principal` is then :func:`current_principal` in the handler.
- :class:`ModelAccess` checks the principal against a model's owner at the entry of each RPC that names one.

A service started without auth (``--no-auth``) installs no authenticator: every call is :data:`TRUSTED`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

from yieldloop.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
    check_text,
)
from yieldloop.transport import CallInfo
from yieldloop.types import ModelInfo
from yieldloop_server.store import ObjectStore
from yieldloop_server.store.base import ObjectNotFound, PreconditionFailed, check_name

Role = Literal["sample", "train", "admin", "service"]
ROLES: tuple[Role, ...] = ("sample", "train", "admin", "service")
_LEVEL = {"sample": 1, "train": 2, "admin": 3, "service": 3}
SERVICE_TEAM = "yieldloop"
"""The team of the keys a stack creates for itself (its admin and its services)."""
KEY_CACHE_S = 5.0
"""How long a checked key is trusted without reading its record again: a revocation reaches every service
within this many seconds (at once on the CheckpointService that revoked it)."""
KEY_PREFIX = "yl_"


@dataclasses.dataclass(frozen=True)
class Principal:
    """Who a call acts for."""

    team: str
    role: Role
    key_id: str = ""

    def at_least(self, role: Role) -> bool:
        return _LEVEL[self.role] >= _LEVEL[role]

    @property
    def is_admin(self) -> bool:
        return self.at_least("admin")


TRUSTED = Principal(team=SERVICE_TEAM, role="service")
"""The principal of every call where no authenticator runs (``--no-auth``) and of the services' own work."""
_principal: contextvars.ContextVar[Principal] = contextvars.ContextVar("yieldloop_principal", default=TRUSTED)


def current_principal() -> Principal:
    """The principal of the call being handled (:data:`TRUSTED` without auth)."""
    return _principal.get()


@dataclasses.dataclass(frozen=True)
class ApiKeyRecord:
    """A stored key: never its secret, only the secret's sha256."""

    key_id: str
    team: str
    role: Role
    secret_sha256: str
    name: str = ""
    created_time: float = 0.0
    revoked_time: float = 0.0


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def split_key(key: str) -> tuple[str, str] | None:
    """(key id, secret) of a well-formed key, else None."""
    if not key.startswith(KEY_PREFIX):
        return None
    key_id, sep, secret = key[len(KEY_PREFIX) :].partition("_")
    if not sep or len(key_id) != 12 or not secret or len(key) > 256:
        return None
    return key_id, secret


def check_role(role: str) -> Role:
    if role not in ROLES:
        raise InvalidArgumentError(
            f"role must be one of {', '.join(ROLES)}, got {role!r}", reason="INVALID_FIELD", field="role"
        )
    return role  # type: ignore[return-value]


class KeyStore:
    """API key records in the object store, with a short-lived cache of checked keys."""

    PREFIX = "auth/keys/"

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self._checked: dict[str, tuple[Principal | None, float]] = {}

    def create(self, team: str, role: str, name: str = "") -> tuple[ApiKeyRecord, str]:
        """A new key for ``team`` with ``role``: its record and the key itself (shown once, stored hashed)."""
        check_name(team, "team")
        check_role(role)
        key_id, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
        record = ApiKeyRecord(key_id, team, role, _hash(secret), check_text(name, "name", 200), time.time())
        self.store.put_bytes(self._key(key_id), json.dumps(dataclasses.asdict(record)).encode(), if_none_match=True)
        return record, f"{KEY_PREFIX}{key_id}_{secret}"

    def adopt(self, key: str, team: str, role: str, name: str = "") -> ApiKeyRecord:
        """Registers a key made elsewhere (a deployment's Secret: ``yl_<12 hex>_<secret>``) for ``team`` with
        ``role``, unless it is registered already; INVALID_ARGUMENT for a malformed key, ALREADY_EXISTS when its id
        belongs to another key."""
        parts = split_key(key)
        if parts is None:
            raise InvalidArgumentError("a key is yl_<12 hex digits>_<secret>", reason="API_KEY_INVALID", field="key")
        key_id, secret = parts
        check_name(team, "team")
        check_role(role)
        record = ApiKeyRecord(key_id, team, role, _hash(secret), check_text(name, "name", 200), time.time())
        try:
            self.store.put_bytes(self._key(key_id), json.dumps(dataclasses.asdict(record)).encode(), if_none_match=True)
        except PreconditionFailed:
            record = self.get(key_id)
            if not hmac.compare_digest(record.secret_sha256, _hash(secret)) or record.role != role:
                raise AlreadyExistsError(
                    f"API key id {key_id} is registered for another key or role", reason="API_KEY_INVALID", field="key"
                ) from None
        return record

    def _key(self, key_id: str) -> str:
        return f"{self.PREFIX}{key_id}.json"

    def get(self, key_id: str) -> ApiKeyRecord:
        try:
            data, _ = self.store.get_bytes(self._key(check_name(key_id, "key_id")))
        except ObjectNotFound:
            raise NotFoundError(f"no API key {key_id!r}", reason="API_KEY_NOT_FOUND", field="key_id") from None
        return ApiKeyRecord(**json.loads(data))

    def list(self) -> list[ApiKeyRecord]:
        """Every key (revoked ones too), oldest first."""
        records = []
        for key in self.store.list(self.PREFIX):
            with contextlib.suppress(ObjectNotFound):
                records.append(ApiKeyRecord(**json.loads(self.store.get_bytes(key)[0])))
        return sorted(records, key=lambda r: r.created_time)

    def revoke(self, key_id: str) -> ApiKeyRecord:
        """Marks the key revoked (its record stays, for the audit trail); idempotent."""
        record = self.get(key_id)
        if not record.revoked_time:
            record = dataclasses.replace(record, revoked_time=time.time())
            self.store.put_bytes(self._key(key_id), json.dumps(dataclasses.asdict(record)).encode())
        self._checked = {k: v for k, v in self._checked.items() if (v[0] is None or v[0].key_id != key_id)}
        return record

    def check(self, key: str) -> Principal | None:
        """The principal of a valid key; None for a malformed, unknown or revoked one. Reads the store at most
        once per key every :data:`KEY_CACHE_S` (blocking: call it off the event loop on a cache miss)."""
        parts = split_key(key)
        if parts is None:
            return None
        key_id, secret = parts
        try:
            record = self.get(key_id)
        except (NotFoundError, InvalidArgumentError):
            record = None
        principal = None
        if record is not None and not record.revoked_time and hmac.compare_digest(record.secret_sha256, _hash(secret)):
            principal = Principal(record.team, record.role, key_id)
        if len(self._checked) > 10_000:  # bounded: a flood of made-up keys cannot grow it without end
            self._checked.clear()
        self._checked[key] = (principal, time.monotonic() + KEY_CACHE_S)
        return principal

    def cached(self, key: str) -> tuple[bool, Principal | None]:
        """(whether a fresh answer is cached, that answer)."""
        entry = self._checked.get(key)
        if entry is None or entry[1] < time.monotonic():
            return False, None
        return True, entry[0]


OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")
"""Method prefixes answered without a key (probes, tooling)."""

METHOD_ROLES: dict[str, Role] = {
    # EnvService: any team may run episodes.
    "/yieldloop.env.v1.EnvService/ListScenarios": "sample",
    "/yieldloop.env.v1.EnvService/StreamEpisode": "sample",
    "/yieldloop.env.v1.EnvService/StreamEpisodes": "sample",
    # RolloutService: sampling (the model itself is checked by ModelAccess).
    "/yieldloop.rollout.v1.RolloutService/Generate": "sample",
    "/yieldloop.rollout.v1.RolloutService/StreamRollouts": "sample",
    "/yieldloop.rollout.v1.RolloutService/GetRuns": "sample",
    "/yieldloop.rollout.v1.RolloutService/GetServingInfo": "sample",
    "/yieldloop.rollout.v1.RolloutService/CreateJob": "sample",
    "/yieldloop.rollout.v1.RolloutService/ListJobs": "sample",
    "/yieldloop.rollout.v1.RolloutService/StreamJobRuns": "sample",
    "/yieldloop.rollout.v1.RolloutService/GetTraceSpans": "sample",
    "/yieldloop.rollout.v1.RolloutService/RecordRuns": "sample",
    # TrainerService.
    "/yieldloop.trainer.v1.TrainerService/ForwardBackward": "train",
    "/yieldloop.trainer.v1.TrainerService/Forward": "train",
    "/yieldloop.trainer.v1.TrainerService/Backward": "train",
    "/yieldloop.trainer.v1.TrainerService/OptimStep": "train",
    "/yieldloop.trainer.v1.TrainerService/ListLosses": "sample",
    "/yieldloop.trainer.v1.TrainerService/GetTrainerInfo": "sample",
    "/yieldloop.trainer.v1.TrainerService/DiscardGradients": "train",
    "/yieldloop.trainer.v1.TrainerService/PullWeights": "service",
    "/yieldloop.trainer.v1.TrainerService/SubscribeWeights": "service",
    # CheckpointService.
    "/yieldloop.checkpoint.v1.CheckpointService/ListModels": "sample",
    "/yieldloop.checkpoint.v1.CheckpointService/GetModel": "sample",
    "/yieldloop.checkpoint.v1.CheckpointService/ForkModel": "train",
    "/yieldloop.checkpoint.v1.CheckpointService/DeleteModel": "train",
    "/yieldloop.checkpoint.v1.CheckpointService/ImportModel": "train",
    "/yieldloop.checkpoint.v1.CheckpointService/UploadModel": "train",
    "/yieldloop.checkpoint.v1.CheckpointService/ListCheckpoints": "sample",
    "/yieldloop.checkpoint.v1.CheckpointService/GetCheckpoint": "sample",
    "/yieldloop.checkpoint.v1.CheckpointService/CommitCheckpoint": "train",
    "/yieldloop.checkpoint.v1.CheckpointService/GetHead": "sample",
    "/yieldloop.checkpoint.v1.CheckpointService/SetHead": "train",
    "/yieldloop.checkpoint.v1.CheckpointService/WatchHead": "sample",
    "/yieldloop.checkpoint.v1.CheckpointService/RecordPromotion": "train",
    "/yieldloop.checkpoint.v1.CheckpointService/CreateApiKey": "admin",
    "/yieldloop.checkpoint.v1.CheckpointService/ListApiKeys": "admin",
    "/yieldloop.checkpoint.v1.CheckpointService/RevokeApiKey": "admin",
    # The OpenAI-compatible HTTP endpoint.
    "GET /v1/models": "sample",
    "POST /v1/completions": "sample",
    "POST /v1/chat/completions": "sample",
    # The HUD front (HUD's cloud contracts; each call it makes for a request carries the request's key too).
    "GET /v2/models": "sample",
    "GET /v2/models/resolve": "sample",
    "GET /v2/models/{model}": "sample",
    "GET /v2/models/{model}/checkpoints": "sample",
    "POST /v2/models/fork": "train",
    "PUT /v2/models/{model}/head": "train",
    "GET /v1/models/{model}/train/losses": "sample",
    "POST /v1/models/{model}/train/forward-backward": "train",
    "POST /v1/models/{model}/train/forward": "train",
    "POST /v1/models/{model}/train/backward": "train",
    "POST /v1/models/{model}/train/optim-step": "train",
    "POST /v2/trace/job/{job_id}/enter": "sample",
    "POST /v2/trace/{trace_id}/enter": "sample",
    "POST /v2/trace/{trace_id}/exit": "sample",
    "POST /v3/api/trace/{trace_id}/telemetry-upload": "sample",
}
"""The least role each method needs. A gRPC method missing here needs admin (a new RPC is closed until it is
listed); an unknown HTTP path needs a valid key (it answers 404)."""


def required_role(call: CallInfo) -> Role:
    return METHOD_ROLES.get(call.method, "admin" if call.protocol == "grpc" else "sample")


def presented_key(call: CallInfo) -> str:
    """The key a call carries (``authorization: Bearer`` or ``x-api-key``), "" when none."""
    authorization = call.header("authorization")
    if authorization[:7].lower() == "bearer ":
        return authorization[7:].strip()
    return call.header("x-api-key").strip()


class Authenticator:
    """The transport interceptor that authenticates every call and checks its method's role."""

    def __init__(self, keys: KeyStore) -> None:
        self.keys = keys

    async def principal(self, key: str) -> Principal | None:
        fresh, principal = self.keys.cached(key)
        if not fresh:
            principal = await asyncio.to_thread(self.keys.check, key)
        return principal

    @contextlib.asynccontextmanager
    async def intercept(self, call: CallInfo) -> AsyncIterator[None]:
        if call.method.startswith(OPEN_METHODS):
            yield
            return
        key = presented_key(call)
        if not key:
            raise UnauthenticatedError(
                "this call needs an API key (authorization: Bearer <key>, or x-api-key); "
                "`yieldloop keys create` makes one",
                reason="API_KEY_MISSING",
            )
        principal = await self.principal(key)
        if principal is None:
            raise UnauthenticatedError("the API key is unknown or revoked", reason="API_KEY_INVALID")
        role = required_role(call)
        if not principal.at_least(role):
            raise PermissionDeniedError(
                f"{call.method} needs a {role} key; this key of team {principal.team!r} is {principal.role}",
                reason="ROLE_NOT_ALLOWED",
            )
        token = _principal.set(principal)
        try:
            yield
        finally:
            _principal.reset(token)


Action = Literal["see", "sample", "train"]


def may(principal: Principal, info: ModelInfo, action: Action) -> bool:
    """Whether ``principal`` may ``action`` the model: see and sample the team's models and public ones; train
    (fork from, commit to, move the head of, delete) only the team's own; admins anything."""
    if principal.is_admin:
        return True
    own = bool(info.owner) and info.owner == principal.team
    if action == "train":
        return own and principal.at_least("train")
    return own or info.public


class ModelAccess:
    """Checks the current principal against the models a call names (their records cached briefly)."""

    def __init__(self, get_model: Callable[[str], Awaitable[ModelInfo]], ttl_s: float = 30.0) -> None:
        self.get_model = get_model
        self.ttl_s = ttl_s
        """How long a model's record (its owner) is reused without reading it again."""
        self._infos: dict[str, tuple[ModelInfo, float]] = {}

    @classmethod
    def through(cls, checkpoints: Any, default: str) -> ModelAccess:
        """Model records read through a CheckpointService client (None: a service of ``default`` alone, e.g. an
        engine served for a benchmark, knows no other model)."""

        async def get_model(slug: str) -> ModelInfo:
            if checkpoints is None:
                raise NotFoundError(f"this service serves only {default!r}", reason="MODEL_NOT_FOUND")
            return await checkpoints.get_model(slug)

        return cls(get_model)

    async def info(self, slug: str) -> ModelInfo:
        entry = self._infos.get(slug)
        if entry is None or entry[1] < time.monotonic():
            entry = (await self.get_model(slug), time.monotonic() + self.ttl_s)
            self._infos[slug] = entry
        return entry[0]

    async def require(self, slug: str, action: Action) -> None:
        """PERMISSION_DENIED (MODEL_NOT_OWNED) unless the caller may ``action`` the model; NOT_FOUND for an
        unknown model (checked only for callers that are not admins)."""
        principal = current_principal()
        if principal.is_admin:
            return
        info = await self.info(slug)
        if not may(principal, info, action):
            verb = {"see": "read", "sample": "sample", "train": "train or change"}[action]
            raise PermissionDeniedError(
                f"team {principal.team!r} may not {verb} model {slug!r} (owned by {info.owner or 'nobody'!r}"
                f"{', public' if info.public else ''})",
                reason="MODEL_NOT_OWNED",
                field="model",
            )

    def forget(self, slug: str) -> None:
        self._infos.pop(slug, None)


def require_job(team: str, job_id: str) -> None:
    """PERMISSION_DENIED (JOB_NOT_OWNED) unless the caller's team made the job (admins: any job)."""
    principal = current_principal()
    if not principal.is_admin and team != principal.team:
        raise PermissionDeniedError(f"job {job_id!r} belongs to another team", reason="JOB_NOT_OWNED", field="job_id")


def require_run(team: str, trace_id: str) -> None:
    """PERMISSION_DENIED (RUN_NOT_OWNED) unless the caller's team ran it (admins: any run)."""
    principal = current_principal()
    if not principal.is_admin and team != principal.team:
        raise PermissionDeniedError(
            f"run {trace_id!r} belongs to another team", reason="RUN_NOT_OWNED", field="trace_id"
        )


def sees_job(team: str) -> bool:
    principal = current_principal()
    return principal.is_admin or team == principal.team
