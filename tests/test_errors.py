"""Bad input answers with the right status and reason, and every service keeps serving."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from yieldloop import errors
from yieldloop.client import Client, sampling_params
from yieldloop.envs.letters import repeat
from yieldloop.proto.common.v1 import common_pb2 as common_pb


async def assert_still_serving(client: Client) -> None:
    assert (await client.list_scenarios()).scenarios
    assert (await client.get_head("tiny")).checkpoint_id
    assert {loss.name for loss in (await client.list_losses())} >= {"importance_sampling", "ppo"}
    assert (await client.get_serving_info()).weight_version


async def test_unknown_scenario_is_not_found(client: Client) -> None:
    task = common_pb.Task(env="letters", scenario="no_such_scenario", args_json="{}")
    with pytest.raises(errors.NotFoundError) as err:
        async with client.episode(task):
            pass
    assert err.value.code == "NOT_FOUND" and err.value.reason == "SCENARIO_NOT_FOUND"
    assert isinstance(err.value, LookupError) and isinstance(err.value, errors.YieldloopError)
    with pytest.raises(errors.NotFoundError) as err:
        _ = [run async for run in client.stream_rollouts([task], group_size=2)]
    assert err.value.reason == "SCENARIO_NOT_FOUND"
    await assert_still_serving(client)


async def test_scenario_args_that_do_not_bind_are_invalid(client: Client) -> None:
    with pytest.raises(errors.InvalidArgumentError) as err:
        repeat.task(colour="red")
    assert err.value.reason == "SCENARIO_ARGS_INVALID"
    task = common_pb.Task(env="letters", scenario="repeat", args_json='{"colour": "red"}')
    with pytest.raises(errors.InvalidArgumentError) as err:
        async with client.episode(task):
            pass
    assert err.value.code == "INVALID_ARGUMENT" and err.value.reason == "SCENARIO_ARGS_INVALID"
    assert isinstance(err.value, ValueError)
    await assert_still_serving(client)


async def test_datum_with_mismatched_logprobs_is_invalid(client: Client) -> None:
    datum = common_pb.Datum(
        input_tokens=[1, 2, 3], target_tokens=[2, 3, 4], sampling_logprobs=[-1.0, -1.0], advantages=[0, 1, 1]
    )
    with pytest.raises(errors.InvalidArgumentError) as err:
        await client.forward_backward(datums=[datum])
    assert err.value.reason == "DATUM_INVALID"
    assert err.value.field == "datums[0].sampling_logprobs"
    assert (await client.get_trainer_info()).num_pending_datums == 0, "a rejected batch leaves no gradient"
    await assert_still_serving(client)


async def test_set_head_to_missing_checkpoint_is_not_found(client: Client) -> None:
    before = await client.get_head("tiny")
    with pytest.raises(errors.NotFoundError) as err:
        await client.set_head("tiny", "no-such-checkpoint")
    assert err.value.reason == "CHECKPOINT_NOT_FOUND"
    assert await client.get_head("tiny") == before, "HEAD untouched"
    await assert_still_serving(client)


@pytest.mark.parametrize(
    ("call", "error", "reason"),
    [
        (
            lambda c: c.generate([10**6], sampling=sampling_params(max_tokens=2)),
            errors.InvalidArgumentError,
            "TOKEN_OUT_OF_VOCAB",
        ),
        (
            lambda c: c.generate([1, 2], sampling=sampling_params(max_tokens=0)),
            errors.InvalidArgumentError,
            "INVALID_FIELD",
        ),
        (
            lambda c: c.generate([1, 2], sampling=sampling_params(max_tokens=2, temperature=-1)),
            errors.InvalidArgumentError,
            "INVALID_FIELD",
        ),
        (
            lambda c: c.generate([1] * 2100, sampling=sampling_params(max_tokens=2)),
            errors.InvalidArgumentError,
            "PROMPT_TOO_LONG",
        ),
        (lambda c: c.generate([1, 2], model="other-model"), errors.NotFoundError, "MODEL_NOT_FOUND"),
        (
            lambda c: c.forward_backward(datums=[common_pb.Datum(input_tokens=[1], target_tokens=[2])], loss_fn="nope"),
            errors.InvalidArgumentError,
            "LOSS_UNKNOWN",
        ),
        (lambda c: c.forward_backward(datums=[]), errors.InvalidArgumentError, "INVALID_FIELD"),
        (
            lambda c: c.forward_backward(
                datums=[common_pb.Datum(input_tokens=[1], target_tokens=[2], advantages=[float("nan")])]
            ),
            errors.InvalidArgumentError,
            "DATUM_INVALID",
        ),
        (lambda c: c.optim_step(1e-3), errors.FailedPreconditionError, "NO_GRADIENTS"),
        (
            lambda c: c.forward_backward(
                datums=[common_pb.Datum(input_tokens=[1], target_tokens=[2])],
                loss_fn="ppo",
                loss_fn_config={"beta": 0.1},
            ),
            errors.InvalidArgumentError,
            "INVALID_FIELD",
        ),
        (
            lambda c: c.forward_backward(
                runs=[
                    common_pb.Run(
                        group_id="g",
                        reward=1.0,
                        turns=[
                            common_pb.Turn(
                                prompt_token_ids=[1, 2], completion_token_ids=[3], completion_logprobs=[-1.0]
                            )
                        ],
                    )
                ],
                group_size=4,
            ),
            errors.InvalidArgumentError,
            "GROUP_INCOMPLETE",
        ),
        (lambda c: c.get_head("../etc"), errors.InvalidArgumentError, "INVALID_FIELD"),
        (lambda c: c.get_head("missing-model"), errors.NotFoundError, "MODEL_NOT_FOUND"),
        (
            lambda c: c.set_head("tiny", "base", expected_checkpoint_id="not-the-head"),
            errors.AbortedError,
            "HEAD_CONFLICT",
        ),
        (lambda c: c.fork_model("tiny", ""), errors.InvalidArgumentError, "INVALID_FIELD"),
        (lambda c: c.fork_model("tiny", "a/b"), errors.InvalidArgumentError, "INVALID_FIELD"),
        (lambda c: c.fork_model("tiny", "x" * 129), errors.InvalidArgumentError, "INVALID_FIELD"),
        (lambda c: c.fork_model("no-such-model", "copy"), errors.NotFoundError, "MODEL_NOT_FOUND"),
        (lambda c: c.get_checkpoint("tiny", "../HEAD"), errors.InvalidArgumentError, "INVALID_FIELD"),
        (lambda c: c.get_checkpoint("tiny", "a..b"), errors.InvalidArgumentError, "INVALID_FIELD"),
        (lambda c: c.set_head("tiny", "checkpoints/base"), errors.InvalidArgumentError, "INVALID_FIELD"),
        (lambda c: c.list_checkpoints(""), errors.InvalidArgumentError, "INVALID_FIELD"),
    ],
    ids=[
        "token-out-of-vocab",
        "max-tokens-zero",
        "negative-temperature",
        "prompt-too-long",
        "unknown-model",
        "unknown-loss",
        "empty-batch",
        "nan-advantage",
        "step-without-gradients",
        "unknown-knob",
        "incomplete-group",
        "slug-with-dots",
        "missing-model",
        "lost-head-race",
        "empty-fork-name",
        "fork-name-with-slash",
        "oversized-fork-name",
        "fork-missing-model",
        "checkpoint-id-dotdot",
        "checkpoint-id-with-dots",
        "head-id-with-slash",
        "empty-slug",
    ],
)
async def test_bad_input_is_typed(client: Client, call, error, reason) -> None:
    with pytest.raises(error) as err:
        await call(client)
    assert err.value.reason == reason, str(err.value)
    await assert_still_serving(client)


async def test_health_and_reflection(stack) -> None:
    names = {
        "checkpoint": "yieldloop.checkpoint.v1.CheckpointService",
        "env": "yieldloop.env.v1.EnvService",
        "trainer": "yieldloop.trainer.v1.TrainerService",
        "rollout": "yieldloop.rollout.v1.RolloutService",
    }
    for service, address in stack.addresses.items():
        async with grpc.aio.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            status = await health.Check(health_pb2.HealthCheckRequest(service=names[service]))
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            async for response in call:
                listed = {s.name for s in response.list_services_response.service}
                assert names[service] in listed and "grpc.health.v1.Health" in listed
                break


async def test_rollout_server_for_unknown_model_fails_fast(stack, tmp_path) -> None:
    from yieldloop.transport import TransportConfig
    from yieldloop_server.rollout.server import RolloutServer
    from yieldloop_server.store import open_store

    server = RolloutServer(
        "no-such-model",
        open_store(stack.config.store_url),
        stack.addresses["checkpoint"],
        stack.addresses["env"],
        tmp_path,
        transport=TransportConfig(api_key=stack.api_key),
    )
    with pytest.raises(errors.NotFoundError) as err:
        await server.start()
    assert err.value.reason == "MODEL_NOT_FOUND"


async def test_a_client_stream_that_fails_to_build_raises_its_own_error(client) -> None:
    """An error while the client produces a stream's messages is raised as itself, not as grpc's CANCELLED."""
    with pytest.raises(errors.InvalidArgumentError, match="num_substeps"):
        await client.forward_backward(runs=_bad_runs())


def _bad_runs():
    yield "not-a-trace-id-that-matters"
    raise errors.InvalidArgumentError("num_substeps must be >= 1", reason="INVALID_FIELD", field="num_substeps")


@pytest.mark.parametrize(
    "text",
    ['{"by": 1}', ' {"by": 1}\n', "[1, 2.5]", '"x"', "12", "null", "NaN", "[]", "{}", "nul", '{"a": 1} x', "", "{"],
)
def test_json_is_read_as_json_loads_reads_it(text: str) -> None:
    """Every caller's JSON goes through parse_json: the same values json.loads gives, INVALID_ARGUMENT naming the
    field where json.loads refuses, whichever way it reads them (C's scanner alone for a bare value), as str and
    bytes."""
    import json

    for given in (text, text.encode()):
        try:
            expected = json.loads(given)
        except ValueError:
            with pytest.raises(errors.InvalidArgumentError) as err:
                errors.parse_json(given, "call_tool.arguments_json", "TOOL_ARGS_INVALID")
            assert err.value.reason == "TOOL_ARGS_INVALID" and err.value.field == "call_tool.arguments_json"
            continue
        got = errors.parse_json(given, "f")
        assert repr(got) == repr(expected) and type(got) is type(expected)


def test_json_nested_deeper_than_the_limit_is_refused_where_it_enters() -> None:
    for depth, ok in ((errors.MAX_JSON_DEPTH, True), (errors.MAX_JSON_DEPTH + 1, False), (5000, False)):
        for text in ("[" * depth + "]" * depth, '{"a": ' * depth + "1" + "}" * depth):
            if ok:
                assert errors.parse_json(text, "f") is not None
                continue
            with pytest.raises(errors.InvalidArgumentError) as err:
                errors.parse_json(text, "f")
            assert "nests deeper" in err.value.message
