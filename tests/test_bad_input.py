"""Property-style bad input over every RPC (issue 14): for each RPC a valid request, and for each of its fields
(nested ones too) values generated from the field's type: NaN, infinities and extreme numbers, negative and
maximal integers, empty, huge, newline, path-like and NUL strings, unknown enum values. Every answer is OK or a
typed status (never INTERNAL or UNKNOWN), INVALID_ARGUMENT carries a reason, and the services keep serving."""

from __future__ import annotations

import collections
import copy
import math
from typing import Any

import grpc
import pytest
import pytest_asyncio
from google.protobuf import descriptor, json_format

from yieldloop._status import error_from_rpc
from yieldloop.client import Client
from yieldloop.proto.checkpoint.v1 import checkpoint_service_pb2 as ckpt
from yieldloop.proto.env.v1 import env_service_pb2 as env
from yieldloop.proto.rollout.v1 import rollout_service_pb2 as rollout
from yieldloop.proto.trainer.v1 import trainer_service_pb2 as trainer

FD = descriptor.FieldDescriptor
DATUM = {
    "inputTokens": [1, 40, 41],
    "targetTokens": [40, 41, 42],
    "samplingLogprobs": [-1.0, -1.0, -1.0],
    "advantages": [0.5, 0.5, 0.5],
    "weights": [1.0, 1.0, 1.0],
}
TASK = {"env": "letters", "scenario": "repeat", "argsJson": '{"letter": "a"}'}
RUN = {
    "runId": "r1",
    "task": TASK,
    "groupId": "g1",
    "prompt": "Say a.",
    "answer": "a",
    "reward": 1.0,
    "status": 1,
    "infoJson": "{}",
    "model": "fuzz-trainee",
    "agentStopReason": 1,
    "promptFormat": 1,
    "turns": [
        {
            "promptTokenIds": [1, 40],
            "completionTokenIds": [41, 42],
            "completionLogprobs": [-1.0, -1.0],
            "weightVersion": "base",
            "completionText": "a",
            "stopReason": 1,
        }
    ],
}

# (service, method, request class, baseline(s) as JSON; a list is a client stream).
CASES: list[tuple[str, str, Any, Any]] = [
    ("checkpoint", "ListModels", ckpt.ListModelsRequest, {}),
    ("checkpoint", "GetModel", ckpt.GetModelRequest, {"model": "tiny"}),
    (
        "checkpoint",
        "ForkModel",
        ckpt.ForkModelRequest,
        {
            "source": "tiny",
            "name": "fuzz-fork",
            "owner": "team",
            "lora": {"rank": 4, "alpha": 8, "targetModules": ["q_proj"]},
        },
    ),
    ("checkpoint", "DeleteModel", ckpt.DeleteModelRequest, {"model": "no-such-model"}),
    ("checkpoint", "ImportModel", ckpt.ImportModelRequest, {"source": "/no/such/folder", "name": "fuzz-import"}),
    (
        "checkpoint",
        "UploadModel",
        ckpt.UploadModelRequest,
        [
            {
                "header": {
                    "name": "fuzz-upload",
                    "owner": "",
                    "source": "./mine",
                    "files": [
                        {
                            "name": "config.json",
                            "size": 2,
                            "sha256": "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a",
                        }
                    ],
                }
            },
            {"chunk": "e30="},
        ],
    ),
    ("checkpoint", "ListCheckpoints", ckpt.ListCheckpointsRequest, {"model": "tiny"}),
    ("checkpoint", "GetCheckpoint", ckpt.GetCheckpointRequest, {"model": "tiny", "checkpointId": "base"}),
    (
        "checkpoint",
        "CommitCheckpoint",
        ckpt.CommitCheckpointRequest,
        {
            "manifest": {
                "model": "tiny",
                "checkpointId": "fuzz-c",
                "parentCheckpointId": "base",
                "step": 1,
                "metadataJson": "{}",
                "objects": [
                    {"name": "a.bin", "size": 1, "sha256": "00", "key": "models/tiny/checkpoints/fuzz-c/a.bin"}
                ],
            },
            "setHead": True,
            "expectedHeadCheckpointId": "base",
        },
    ),
    ("checkpoint", "GetHead", ckpt.GetHeadRequest, {"model": "tiny"}),
    (
        "checkpoint",
        "SetHead",
        ckpt.SetHeadRequest,
        {"model": "tiny", "checkpointId": "base", "expectedCheckpointId": "base"},
    ),
    (
        "checkpoint",
        "RecordPromotion",
        ckpt.RecordPromotionRequest,
        {
            "model": "tiny",
            "checkpointId": "base",
            "promotion": {
                "state": "PROMOTION_STATE_REJECTED",
                "reason": "fuzz",
                "heldoutReward": 0.5,
                "baselineCheckpointId": "base",
                "baselineReward": 0.4,
                "decidedTime": 1.0,
            },
        },
    ),
    ("checkpoint", "CreateApiKey", ckpt.CreateApiKeyRequest, {"team": "fuzz-team", "role": "sample", "name": "fuzz"}),
    ("checkpoint", "ListApiKeys", ckpt.ListApiKeysRequest, {}),
    ("checkpoint", "RevokeApiKey", ckpt.RevokeApiKeyRequest, {"keyId": "000000000000"}),
    ("env", "ListScenarios", env.ListScenariosRequest, {}),
    ("env", "StreamEpisode", env.StreamEpisodeRequest, [{"start": {"task": TASK}}, {"submit": {"answer": "a"}}]),
    (
        "env",
        "StreamEpisodes",
        env.StreamEpisodesRequest,
        [
            {
                "frames": [
                    {"tag": "1", "request": {"start": {"task": TASK}}, "traceContext": {"traceparent": "00-ab-cd-01"}}
                ]
            },
            {
                "frames": [
                    {"tag": "1", "request": {"submit": {"answer": "a"}}, "close": True},
                    {"tag": "2", "close": True},
                ]
            },
        ],
    ),
    (
        "rollout",
        "Generate",
        rollout.GenerateRequest,
        {
            "model": "tiny",
            "promptTokenIds": {"tokenIds": [1, 40, 41]},
            "sampling": {"maxTokens": 2, "temperature": 1.0, "topP": 0.9, "topK": 5, "seed": 3, "stop": ["x"]},
        },
    ),
    (
        "rollout",
        "Generate",
        rollout.GenerateRequest,
        {"chat": {"messages": [{"role": "user", "content": "Say a."}]}, "sampling": {"maxTokens": 2}},
    ),
    (
        "rollout",
        "StreamRollouts",
        rollout.StreamRolloutsRequest,
        {
            "tasks": [TASK],
            "groupSize": 1,
            "maxConcurrent": 1,
            "sampling": {"maxTokens": 3},
            "jobId": "fuzz-job",
            "maxSteps": 2,
            "episodeTimeoutS": 30,
            "maxAttempts": 1,
        },
    ),
    ("rollout", "GetRuns", rollout.GetRunsRequest, {"traceIds": ["no-such-trace"]}),
    ("rollout", "GetTraceSpans", rollout.GetTraceSpansRequest, {"traceId": "0" * 32}),
    ("rollout", "GetServingInfo", rollout.GetServingInfoRequest, {"model": "tiny"}),
    (
        "rollout",
        "CreateJob",
        rollout.CreateJobRequest,
        {"model": "tiny", "name": "fuzz", "groupSize": 2, "metadataJson": "{}"},
    ),
    ("rollout", "ListJobs", rollout.ListJobsRequest, {}),
    (
        "rollout",
        "RecordRuns",
        rollout.RecordRunsRequest,
        {
            "jobId": "fuzz-recorded",
            "job": {"model": "tiny", "name": "fuzz", "groupSize": 1, "metadataJson": "{}"},
            "runs": [{"traceId": "f" * 32, "groupId": "g", "reward": 1.0, "status": "RUN_STATUS_GRADED"}],
        },
    ),
    ("rollout", "StreamJobRuns", rollout.StreamJobRunsRequest, {"jobId": "no-such-job"}),
    (
        "trainer",
        "ForwardBackward",
        trainer.ForwardBackwardRequest,
        [
            {
                "config": {
                    "lossFn": "ppo",
                    "lossFnConfig": {"clip_low_threshold": 0.8},
                    "rewardScale": 1.0,
                    "groupSize": 0,
                    "model": "fuzz-trainee",
                }
            },
            {"datum": DATUM},
        ],
    ),
    (
        "trainer",
        "ForwardBackward",
        trainer.ForwardBackwardRequest,  # runs inline: their enums, JSON, rewards
        [
            {"config": {"lossFn": "importance_sampling", "model": "fuzz-trainee"}},
            {"run": RUN},
            {"run": {**RUN, "reward": 0.0, "runId": "r2"}},
        ],
    ),
    ("trainer", "Forward", trainer.ForwardRequest, [{"datum": DATUM, "model": "fuzz-trainee"}]),
    ("trainer", "Backward", trainer.BackwardRequest, [{"datum": DATUM, "model": "fuzz-trainee"}]),
    (
        "trainer",
        "OptimStep",
        trainer.OptimStepRequest,
        {
            "adam": {
                "learningRate": 1e-4,
                "beta1": 0.9,
                "beta2": 0.95,
                "eps": 1e-8,
                "weightDecay": 0.0,
                "maxGradNorm": 1.0,
            },
            "setHead": True,
            "metadataJson": "{}",
            "model": "fuzz-trainee",
            "idempotencyKey": "k",
        },
    ),
    ("trainer", "ListLosses", trainer.ListLossesRequest, {}),
    ("trainer", "GetTrainerInfo", trainer.GetTrainerInfoRequest, {"model": "fuzz-trainee"}),
    ("trainer", "DiscardGradients", trainer.DiscardGradientsRequest, {"model": "fuzz-trainee"}),
    (
        "trainer",
        "PullWeights",
        trainer.PullWeightsRequest,
        {"model": "fuzz-trainee", "checkpoint_id": "base", "host_id": "elsewhere"},
    ),
]

STRINGS = [
    "",
    "x" * 100_000,
    "evil\n",
    "../../etc/passwd",
    "a\x00b",
    "é☃" * 40,
    "{[",
    "/abs",
    "[" * 100_000 + "]" * 100_000,
    '{"a": ' * 500 + "1" + "}" * 500,
]  # JSON nested past any bound


def values_for(field: descriptor.FieldDescriptor) -> list[Any]:
    if field.type in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        return [
            math.nan,
            math.inf,
            -math.inf,
            1e300 if field.type == FD.TYPE_DOUBLE else 3e38,
            -1e300 if field.type == FD.TYPE_DOUBLE else -3e38,
            -1.0,
            1e-45,
        ]
    if field.type in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32):
        return [-1, 2**31 - 1, -(2**31)]
    if field.type in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
        return [-1, 2**63 - 1, -(2**63)]
    if field.type in (FD.TYPE_UINT32, FD.TYPE_FIXED32):
        return [2**32 - 1]
    if field.type in (FD.TYPE_UINT64, FD.TYPE_FIXED64):
        return [2**64 - 1]
    if field.type == FD.TYPE_STRING:
        return STRINGS
    if field.type == FD.TYPE_BOOL:
        return [True, False]
    if field.type == FD.TYPE_ENUM:
        return [999, -5]
    return []


def mutations(message: Any, path: str = "") -> list[tuple[str, Any]]:
    """(field path, mutated copy of the root) for every field of ``message`` and of its set sub-messages."""
    found = []
    for field in message.DESCRIPTOR.fields:
        name = f"{path}{field.name}"
        is_map = field.message_type is not None and field.message_type.GetOptions().map_entry
        if is_map:
            key_type = field.message_type.fields_by_name["key"]
            value_field = field.message_type.fields_by_name["value"]
            for value in values_for(value_field)[:3]:
                found.append(
                    (
                        name,
                        lambda m, f=field.name, k=("x" if key_type.type == FD.TYPE_STRING else 1), v=value: getattr(
                            m, f
                        ).__setitem__(k, v),
                    )
                )
            continue
        if field.type == FD.TYPE_MESSAGE:
            if field.is_repeated:
                items = getattr(message, field.name)
                if items:
                    found.append((name + "[]", lambda m, f=field.name: m.ClearField(f)))
                    found += [(n, _in_item(field.name, 0, fn)) for n, fn in mutations(items[0], name + "[0].")]
                    found.append(
                        (
                            name + "[x10000]",
                            lambda m, f=field.name: [
                                getattr(m, f).add().CopyFrom(getattr(m, f)[0]) for _ in range(2000)
                            ],
                        )
                    )
            elif message.HasField(field.name):
                found += [(n, _in_sub(field.name, fn)) for n, fn in mutations(getattr(message, field.name), name + ".")]
            continue
        for value in values_for(field):
            if field.is_repeated:
                found.append((name, lambda m, f=field.name, v=value: getattr(m, f).append(v)))
            else:
                found.append((name, lambda m, f=field.name, v=value: setattr(m, f, v)))
        if field.is_repeated and field.type != FD.TYPE_STRING:
            found.append((name + "[x100000]", lambda m, f=field.name: getattr(m, f).extend([1] * 100_000)))
    return found


def _in_sub(name: str, fn: Any) -> Any:
    return lambda m: fn(getattr(m, name))


def _in_item(name: str, index: int, fn: Any) -> Any:
    return lambda m: fn(getattr(m, name)[index])


def generated_cases() -> list[tuple[str, str, list[Any], str]]:
    """(service, method, messages, what was mutated) for every mutation of every baseline."""
    out = []
    for service, method, cls, baseline in CASES:
        messages = [json_format.ParseDict(b, cls()) for b in (baseline if isinstance(baseline, list) else [baseline])]
        out.append((service, method, messages, "baseline"))
        for index, message in enumerate(messages):
            for name, mutate in mutations(message):
                mutated = copy.deepcopy(messages)
                try:
                    mutate(mutated[index])
                except (ValueError, TypeError, OverflowError):
                    continue  # not representable on the wire (e.g. an int64 past its range)
                out.append((service, method, mutated, f"{name}{'' if len(messages) == 1 else f' (message {index})'}"))
    return out


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fuzz_client(tmp_path_factory):
    from yieldloop_server.config import StackConfig, TrainerOptions
    from yieldloop_server.stack import InProcessStack

    stack = InProcessStack(StackConfig(data_dir=tmp_path_factory.mktemp("fuzz"), trainer=TrainerOptions(max_models=4)))
    await stack.start()
    async with Client(**stack.addresses, api_key=stack.api_key, timeout=60) as client:
        await client.fork_model("tiny", "fuzz-trainee")
        client.hud_url = stack.hud_url  # the HUD front's (see test_every_hud_route_answers_bad_input)
        yield client
    await stack.stop()


async def _call(client: Client, service: str, method: str, messages: list[Any]) -> None:
    stub = getattr(client.raw, service)
    rpc = getattr(stub, method)
    streaming_request = method in (
        "StreamEpisode",
        "StreamEpisodes",
        "ForwardBackward",
        "Forward",
        "Backward",
        "UploadModel",
    )
    request = iter(messages) if streaming_request else messages[0]
    call = rpc(request, timeout=60)
    if hasattr(call, "__aiter__"):
        async for response in call:
            if method == "StreamEpisodes":  # an episode's own failure comes in its closing frame
                _raise_in_band(response)
    else:
        await call


def _raise_in_band(response: env.StreamEpisodesResponse) -> None:
    """An episode's failure as the status its own stream would have ended with."""
    from yieldloop._status import to_rpc_status
    from yieldloop.errors import error_from_wire

    for frame in response.frames:
        if frame.HasField("error"):
            status = to_rpc_status(
                error_from_wire(
                    {
                        "code": frame.error.code,
                        "message": frame.error.message,
                        "reason": frame.error.reason,
                        "field": frame.error.field,
                    }
                )
            )
            raise grpc.aio.AioRpcError(
                status.code, grpc.aio.Metadata(), grpc.aio.Metadata(*status.trailing_metadata), status.details
            )


async def test_every_rpc_answers_bad_input_with_a_typed_status(fuzz_client: Client) -> None:
    cases = generated_cases()
    assert len(cases) > 800, len(cases)
    outcomes: collections.Counter[str] = collections.Counter()
    bad = []
    for service, method, messages, what in cases:
        try:
            await _call(fuzz_client, service, method, messages)
            outcomes["OK"] += 1
        except grpc.aio.AioRpcError as err:
            error = error_from_rpc(err)
            outcomes[error.code] += 1
            # RESOURCE_EXHAUSTED counts only with a reason of ours (grpc's own limits carry none).
            untyped = error.code in ("INTERNAL", "UNKNOWN", "DEADLINE_EXCEEDED") or error.reason == "RESOURCE_EXHAUSTED"
            if untyped or (error.code == "INVALID_ARGUMENT" and error.reason == "INVALID_ARGUMENT"):
                bad.append(f"{method} {what}: {error}"[:300])
    print(f"{len(cases)} cases: {dict(outcomes)}")
    assert not bad, f"{len(bad)} untyped answers:\n" + "\n".join(bad[:40])
    # Still serving, every service.
    await fuzz_client.list_models()
    assert (await fuzz_client.generate([1, 40, 41], model="tiny")).token_ids
    assert (await fuzz_client.get_trainer_info(model="fuzz-trainee")).model == "fuzz-trainee"


def test_the_generator_covers_every_rpc() -> None:
    methods = {(s, m) for s, m, _, _ in CASES}
    for module, service in ((ckpt, "checkpoint"), (env, "env"), (rollout, "rollout"), (trainer, "trainer")):
        for svc in module.DESCRIPTOR.services_by_name.values():
            for method in svc.methods:
                # Streams that never end: tested in test_checkpoints and test_weight_group.
                if method.name not in ("WatchHead", "SubscribeWeights"):
                    assert (service, method.name) in methods, f"no bad-input case for {svc.name}.{method.name}"


HTTP_BASELINES = {
    "/completions": {
        "model": "tiny",
        "prompt": [1, 40, 41],
        "max_tokens": 2,
        "temperature": 1.0,
        "top_p": 0.9,
        "top_k": 5,
        "seed": 3,
        "stop": ["x"],
        "n": 1,
        "stream": False,
        "ignore_eos": False,
    },
    "/chat/completions": {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Say a."}],
        "max_completion_tokens": 2,
        "temperature": 1.0,
        "seed": 3,
        "n": 1,
        "stream": False,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    },
}
HTTP_VALUES = [
    "NaN",
    "Infinity",
    "1e300",
    "-1",
    "0",
    "18446744073709551616",
    '"abc"',
    "true",
    "null",
    "[]",
    "{}",
    "[1]",
    "[true]",
    '{"a": 1}',
    "5",
    '"' + "x" * 100_000 + '"',
    "[" * 5000 + "]" * 5000,
    "[" * 100_000 + "]" * 100_000,
]


def _mutations(baseline: dict, raw: tuple[str, ...] = ("", "not json", "[1, 2]", "{", "\x00")) -> list[tuple[str, str]]:
    """(what, body): bodies that are not JSON objects, then the baseline with each field set to each bad value."""
    import json

    bodies = [("raw", text) for text in raw]
    for key in baseline:
        for value in HTTP_VALUES:
            pairs = [f"{json.dumps(k)}: {value if k == key else json.dumps(v)}" for k, v in baseline.items()]
            bodies.append((f"{key}={value[:20]}", "{" + ", ".join(pairs) + "}"))
    return bodies


async def _send_all(
    http, method: str, url: str, bodies: list[tuple[str, str]], statuses: collections.Counter
) -> list[str]:
    """Sends each body; returns what was answered wrong: a 5xx, or a 4xx that is not a typed (OpenAI-shaped) error."""
    import json

    bad = []
    for what, body in bodies:
        async with http.request(
            method, url, data=body.encode(), headers={"content-type": "application/json"}
        ) as response:
            statuses[response.status] += 1
            text = await response.text()
            if response.status >= 500:
                bad.append(f"{method} {url} {what}: {response.status} {text[:200]}")
            elif response.status >= 400:
                error = json.loads(text).get("error", {})
                if not (error.get("type") and error.get("code") and error.get("message")):
                    bad.append(f"{url} {what}: not an OpenAI-shaped error: {text[:200]}")
    return bad


async def test_every_http_route_answers_bad_input_with_an_openai_error(fuzz_client: Client) -> None:
    import aiohttp

    base_url = (await fuzz_client.get_serving_info()).openai_base_url
    bad, statuses = [], collections.Counter()
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {fuzz_client.transport.api_key}"}) as http:
        for route, baseline in HTTP_BASELINES.items():
            bodies = _mutations(baseline)
            if route == "/chat/completions":  # inside a message
                for message in (
                    '{"role": "user", "content": 5}',
                    '{"role": 5, "content": "a"}',
                    '{"role": "user", "content": [5]}',
                    '{"role": "assistant", "tool_calls": 5}',
                    '{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}',
                    '{"role": "assistant", "tool_calls": [{"function": 5}]}',
                    "5",
                ):
                    bodies.append((f"messages=[{message[:30]}]", f'{{"model": "tiny", "messages": [{message}]}}'))
            bad += await _send_all(http, "POST", base_url + route, bodies, statuses)
        async with http.get(base_url + "/models") as response:
            assert response.status == 200
    print(f"HTTP: {dict(statuses)}")
    assert not bad, f"{len(bad)} bad answers:\n" + "\n".join(bad[:40])


_TRAJECTORY = {
    "samples": [{"prompt_token_ids": [1, 40, 41], "output_token_ids": [42], "output_logprobs": [-1.0]}],
    "reward": 1.0,
}
_TRAIN = "/v1/models/fuzz-trainee/train"
HUD_BASELINES = {
    ("POST", f"{_TRAIN}/forward-backward"): {
        "inputs": [_TRAJECTORY, {**_TRAJECTORY, "reward": 0.0}],
        "loss_fn": "importance_sampling",
        "loss_fn_config": {"clip_low_threshold": 0.8},
        "group_size": 2,
        "reward_scale": 1.0,
        "num_substeps": 1,
    },
    ("POST", f"{_TRAIN}/forward"): {"inputs": [_TRAJECTORY], "group_size": 1, "reward_scale": 1.0},
    ("POST", f"{_TRAIN}/backward"): {"forward_id": "f" * 32, "weights": [[0.0, 0.0, 1.0]], "metrics": {"m": 1.0}},
    ("POST", f"{_TRAIN}/optim-step"): {
        "learning_rate": 1e-3,
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-8,
        "weight_decay": 0.0,
    },
    ("PUT", "/v2/models/fuzz-trainee/head"): {"checkpoint_id": "base"},
    ("POST", "/v2/models/fork"): {"source_model_id": "tiny", "name": "fuzz-fork"},
    ("POST", "/v2/trace/job/fuzz-job/enter"): {"name": "j", "group": 2, "taskset_id": "t"},
    ("POST", "/v2/trace/" + "e" * 32 + "/enter"): {
        "job_id": "fuzz-job",
        "group_id": "g",
        "task_slug": "t",
        "model": "tiny",
    },
    ("POST", "/v2/trace/" + "e" * 32 + "/exit"): {
        "status": "completed",
        "reward": 1.0,
        "error": "",
        "evaluation_result": {},
        "metadata": {},
    },
    ("POST", "/v3/api/trace/" + "e" * 32 + "/telemetry-upload"): {"telemetry": []},
    ("POST", "/v1/chat/completions"): {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Say a."}],
        "max_tokens": 2,
        "prompt_token_ids": [1, 2],
        "continuation_from": 1,
    },
}


async def test_every_hud_route_answers_bad_input(fuzz_client: Client) -> None:
    """The HUD front: bodies that are not JSON, and each field set to each bad value, answer typed 4xx."""
    import aiohttp

    bad, statuses = [], collections.Counter()
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {fuzz_client.transport.api_key}"}) as http:
        for (method, route), baseline in HUD_BASELINES.items():
            bad += await _send_all(http, method, fuzz_client.hud_url + route, _mutations(baseline), statuses)
    print(f"HUD front: {dict(statuses)}")
    assert not bad, f"{len(bad)} bad answers:\n" + "\n".join(bad[:40])
    await fuzz_client.list_models()  # every service still serves


async def test_undecodable_messages_are_invalid_argument(fuzz_client: Client, caplog) -> None:
    """Bytes that are not the request message: INVALID_ARGUMENT on every kind of RPC, no traceback logged."""
    import logging

    addresses = {**fuzz_client._addresses, "env": fuzz_client._env_addresses[0]}
    garbage = b"\xff\xff\xff\x01"
    calls = [
        ("checkpoint", "/yieldloop.checkpoint.v1.CheckpointService/GetHead", "unary_unary"),
        ("rollout", "/yieldloop.rollout.v1.RolloutService/Generate", "unary_stream"),
        ("trainer", "/yieldloop.trainer.v1.TrainerService/Forward", "stream_unary"),
        ("env", "/yieldloop.env.v1.EnvService/StreamEpisode", "stream_stream"),
        ("env", "/yieldloop.env.v1.EnvService/StreamEpisodes", "stream_stream"),
    ]
    with caplog.at_level(logging.WARNING):
        for service, method, kind in calls:
            async with grpc.aio.insecure_channel(addresses[service]) as channel:
                rpc = getattr(channel, kind)(method)
                request = garbage if kind.startswith("unary_") else iter([garbage])
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    call = rpc(request, timeout=30, metadata=(("x-api-key", fuzz_client.transport.api_key),))
                    if kind.endswith("_stream"):
                        async for _ in call:
                            pass
                    else:
                        await call
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, err.value)
    assert not [r for r in caplog.records if r.exc_info and "deserializ" in r.getMessage().lower() + "parse"]
    await fuzz_client.list_models()
