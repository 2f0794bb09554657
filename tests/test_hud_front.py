"""The HUD front's HTTP contracts against the session's stack, with plain HTTP (the HUD SDK itself drives them in
tests/test_hud.py): the shapes the SDK validates, its keys' roles and teams, and typed errors."""

from __future__ import annotations

import aiohttp
import pytest

from yieldloop.client import Client

TRAJECTORY = {
    "samples": [{"prompt_token_ids": [1, 40, 41], "output_token_ids": [42, 43], "output_logprobs": [-1.0, -2.0]}],
    "reward": 1.0,
}


async def request(stack, method: str, path: str, key: str | None, body: object = None) -> tuple[int, object]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as http:
        async with http.request(method, stack.hud_url + path, json=body, headers=headers) as response:
            return response.status, await response.json(content_type=None)


async def test_catalog_lists_what_the_key_may_see(stack, client: Client) -> None:
    status, page = await request(stack, "GET", "/v2/models?limit=100&offset=0", stack.api_key)
    assert status == 200 and page["total"] == len(page["items"]) >= 1
    tiny = next(item for item in page["items"] if item["id"] == "tiny")
    assert tiny == {
        "id": "tiny",
        "name": "tiny",
        "model_name": "tiny",
        "sdk_agent_type": "openai_compatible",
        "is_trainable": True,
        "provider": {"name": "yieldloop"},
        "created_at": tiny["created_at"],
    }
    status, one = await request(stack, "GET", "/v2/models/resolve?model=TINY", stack.api_key)
    assert status == 200 and one["id"] == "tiny"
    status, page = await request(stack, "GET", "/v2/models?limit=1&offset=0", stack.api_key)
    assert len(page["items"]) == 1 and page["total"] >= 1
    status, error = await request(stack, "GET", "/v2/models/resolve?model=nothing-here", stack.api_key)
    assert status == 404 and error["error"]["code"] == "model_not_found"


async def test_training_routes_validate_strictly_and_answer_typed(stack, client: Client) -> None:
    await client.fork_model("tiny", "hud-front-model")
    base = "/v1/models/hud-front-model/train"
    key = stack.api_key
    status, losses = await request(stack, "GET", f"{base}/losses", key)
    assert status == 200 and "importance_sampling" in losses["losses"]
    inputs = [TRAJECTORY, {**TRAJECTORY, "reward": 0.0}]
    status, result = await request(stack, "POST", f"{base}/forward-backward", key, {"inputs": inputs, "group_size": 2})
    assert status == 200 and set(result) == {"metrics", "num_datums"} and result["num_datums"] == 2
    assert all(isinstance(v, float) for v in result["metrics"].values())
    for body, field in [
        ({"inputs": inputs, "group_size": 2, "lr": 1}, "lr"),  # the SDK's models forbid unknown fields; so do we
        ({"inputs": inputs, "group_size": 3}, "group_size"),
        (
            {
                "inputs": [
                    {
                        **TRAJECTORY,
                        "samples": [{"prompt_token_ids": [1], "output_token_ids": [2, 3], "output_logprobs": [-1.0]}],
                    }
                ]
            },
            "inputs[0].samples[0].output_logprobs",
        ),
        ({"inputs": [{**TRAJECTORY, "reward": "high"}]}, "inputs[0].reward"),
        ({"inputs": []}, "inputs"),
        ({"inputs": inputs, "loss_fn_config": {"clip": "x"}}, "loss_fn_config.clip"),
    ]:
        status, error = await request(stack, "POST", f"{base}/forward-backward", key, body)
        assert status == 400 and error["error"]["param"] == field, (body, error)
    status, error = await request(stack, "POST", f"{base}/forward-backward", key, {"inputs": inputs, "loss_fn": "nope"})
    assert status == 400 and error["error"]["code"] == "loss_unknown"
    # FastAPI's "detail" too: the HUD SDK's HudRequestError shows it as its one line ("Request failed: ...").
    assert error["detail"].startswith("LOSS_UNKNOWN: ") and error["error"]["message"] in error["detail"]
    status, error = await request(stack, "GET", f"{base}/losses", "yl_wrong_key")
    assert status == 401 and error["detail"].startswith("API_KEY_INVALID: ") and len(error["detail"]) < 200
    # num_substeps as HUD documents it (>= 1, the batch split for gradient accumulation): more than the groups
    # are as many passes as groups.
    status, split = await request(
        stack, "POST", f"{base}/forward-backward", key, {"inputs": inputs, "group_size": 1, "num_substeps": 5}
    )
    assert status == 200 and split["num_datums"] == 2
    status, error = await request(stack, "POST", f"{base}/forward-backward", key, {"inputs": inputs, "num_substeps": 0})
    assert status == 400 and error["error"]["param"] == "num_substeps"
    status, error = await request(stack, "POST", f"{base}/forward-backward", key, {"inputs": ["0" * 32, "1" * 32]})
    assert status == 404 and error["error"]["code"] == "trace_not_found"

    status, forward = await request(stack, "POST", f"{base}/forward", key, {"inputs": inputs, "group_size": 2})
    assert status == 200 and len(forward["data"]) == 2
    datum = forward["data"][0]
    assert set(datum) == {"reward", "traj_idx", "group_idx", "logprobs", "sampling_logprobs", "mask"}
    assert len(datum["logprobs"]) == len(datum["mask"]) == 4 and datum["mask"][-2:] == [1.0, 1.0]
    weights = [[0.0] * 4, [0.0] * 3]
    status, error = await request(
        stack, "POST", f"{base}/backward", key, {"forward_id": forward["forward_id"], "weights": weights}
    )
    assert status == 400 and error["error"]["param"] == "weights[1]"
    weights[1] = [0.0, 0.0, 0.5, 0.5]
    status, done = await request(
        stack, "POST", f"{base}/backward", key, {"forward_id": forward["forward_id"], "weights": weights}
    )
    assert status == 200 and done["num_datums"] == 2
    status, error = await request(
        stack, "POST", f"{base}/backward", key, {"forward_id": forward["forward_id"], "weights": weights}
    )
    assert status == 404 and error["error"]["code"] == "forward_not_found"  # each forward pass is used once

    status, error = await request(stack, "POST", f"{base}/optim-step", key, {"learning_rate": 0})
    assert status == 400 and error["error"]["param"] == "learning_rate"
    status, step = await request(stack, "POST", f"{base}/optim-step", key, {"learning_rate": 1e-3})
    assert status == 200 and set(step) == {"step", "checkpoint_id", "sampler_path", "state_path", "model"}
    assert (await client.get_head("hud-front-model")).checkpoint_id == step["checkpoint_id"]
    status, error = await request(stack, "POST", f"{base}/optim-step", key, {"learning_rate": 1e-3})
    assert status == 400 and error["error"]["code"] == "no_gradients"

    status, rows = await request(stack, "GET", "/v2/models/hud-front-model/checkpoints", key)
    assert [row["id"] for row in rows] == ["base", step["checkpoint_id"]]
    # The step trained the two forward-backwards' trajectories and the custom loss's (forward + backward): 3 x 2.
    assert rows[1]["is_active"] and rows[1]["num_traces"] == 6 and rows[1]["mean_reward"] == 0.5
    status, moved = await request(stack, "PUT", "/v2/models/hud-front-model/head", key, {"checkpoint_id": "base"})
    assert status == 200 and (await client.get_head("hud-front-model")).checkpoint_id == "base"
    status, error = await request(stack, "PUT", "/v2/models/hud-front-model/head", key, {"checkpoint_id": "nope"})
    assert status == 404 and error["error"]["code"] == "checkpoint_not_found"
    status, error = await request(
        stack, "POST", "/v2/models/fork", key, {"source_model_id": "tiny", "name": "hud-front-model"}
    )
    assert status == 409 and error["error"]["code"] == "model_already_exists"


async def test_keys_roles_and_teams(stack, client: Client) -> None:
    """No key: 401; a sample key cannot train (403); another team's model, trace or forward pass is refused."""
    status, error = await request(stack, "GET", "/v2/models", None)
    assert status == 401 and error["error"]["code"] == "api_key_missing"
    status, error = await request(stack, "GET", "/v2/models", "yl_000000000000_nope")
    assert status == 401 and error["error"]["code"] == "api_key_invalid"
    a = (await client.create_api_key("hud-team-a", "train")).api_key
    a_sample = (await client.create_api_key("hud-team-a", "sample")).api_key
    b = (await client.create_api_key("hud-team-b", "train")).api_key
    status, fork = await request(stack, "POST", "/v2/models/fork", a, {"source_model_id": "tiny", "name": "hud-a"})
    assert status == 200 and fork["id"] == "hud-a"
    status, page = await request(stack, "GET", "/v2/models", b)
    assert "hud-a" not in {item["id"] for item in page["items"]}
    body = {"inputs": [TRAJECTORY, {**TRAJECTORY, "reward": 0.0}]}
    status, error = await request(stack, "POST", "/v1/models/hud-a/train/forward-backward", a_sample, body)
    assert status == 403 and error["error"]["code"] == "role_not_allowed"
    status, error = await request(stack, "POST", "/v1/models/hud-a/train/forward-backward", b, body)
    assert status == 403 and error["error"]["code"] == "model_not_owned"
    status, error = await request(stack, "GET", "/v2/models/hud-a/checkpoints", b)
    assert status == 403 and error["error"]["code"] == "model_not_owned"
    status, forward = await request(stack, "POST", "/v1/models/hud-a/train/forward", a, body)
    assert status == 200
    status, error = await request(
        stack,
        "POST",
        "/v1/models/hud-a/train/backward",
        b,
        {"forward_id": forward["forward_id"], "weights": [[0.0] * 4] * 2},
    )
    assert status in (403, 404)

    # A trace belongs to the team that opened it; its exit records a run only that team reads back.
    trace_id = "ab" * 16
    assert (await request(stack, "POST", f"/v2/trace/{trace_id}/enter", a, {"task_slug": "t", "model": "hud-a"}))[
        0
    ] == 200
    status, error = await request(stack, "POST", f"/v2/trace/{trace_id}/exit", b, {"reward": 1.0})
    assert status == 403 and error["error"]["code"] == "run_not_owned"
    status, done = await request(stack, "POST", f"/v2/trace/{trace_id}/exit", a, {"reward": 0.5, "status": "completed"})
    assert status == 200 and done["num_samples"] == 0
    assert (await request(stack, "POST", f"/v2/trace/{trace_id}/exit", a, {"reward": 0.5}))[0] == 200  # repeated
    async with Client(**stack.addresses, api_key=b) as b_client:
        with pytest.raises(Exception, match="RUN_NOT_OWNED|another team"):
            await b_client.get_runs([trace_id])
    async with Client(**stack.addresses, api_key=a) as a_client:
        (run,) = await a_client.get_runs([trace_id])
        assert run.reward == 0.5 and run.team == "hud-team-a" and run.task.scenario == "t"
    status, error = await request(stack, "POST", "/v2/trace/not-hex/enter", a, {})
    assert status == 400 and error["error"]["param"] == "trace_id"


async def test_gateway_records_samples_under_the_trace_id(stack, client: Client) -> None:
    """Chat completions through the front answer as the rollout's endpoint does; with Trace-Id the turns are the
    trace's samples, and a continued turn (prompt_token_ids + continuation_from) extends the previous one."""
    trace_id = "cd" * 16
    key = stack.api_key
    status, _ = await request(stack, "POST", "/v2/trace/job/hud-front-job/enter", key, {"name": "gateway", "group": 1})
    assert status == 200
    status, _ = await request(stack, "POST", f"/v2/trace/{trace_id}/enter", key, {"job_id": "hud-front-job"})
    assert status == 200
    messages = [{"role": "user", "content": [{"type": "text", "text": "Say a."}]}]
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}", "Trace-Id": trace_id}) as http:
        async with http.post(  # an agent that forgot return_token_ids and logprobs: the trace still gets them
            stack.hud_url + "/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 3}
        ) as response:
            assert response.status == 200
            first = (await response.json())["choices"][0]
        assert first["prompt_token_ids"] and first["token_ids"]
        assert len(first["logprobs"]["content"]) == len(first["token_ids"])
        messages += [
            {"role": "assistant", "content": first["message"]["content"] or ""},
            {"role": "user", "content": "Again."},
        ]
        previous = first["prompt_token_ids"] + first["token_ids"]
        continued = {"model": "tiny", "messages": messages, "max_tokens": 3, "prompt_token_ids": previous}
        async with http.post(
            stack.hud_url + "/v1/chat/completions", json={**continued, "logprobs": True, "continuation_from": 2}
        ) as response:
            assert response.status == 200
            second = (await response.json())["choices"][0]
        assert second["prompt_token_ids"][: len(previous)] == previous
        async with http.post(
            stack.hud_url + "/v1/chat/completions", json={**continued, "continuation_from": 1}
        ) as response:
            assert response.status == 400
            assert (await response.json())["error"]["param"] == "continuation_from"
    status, done = await request(stack, "POST", f"/v2/trace/{trace_id}/exit", key, {"reward": 1.0})
    assert status == 200 and done["num_samples"] == 2
    (run,) = await client.get_runs([trace_id])
    assert [t.prompt_token_ids for t in run.turns] == [first["prompt_token_ids"], second["prompt_token_ids"]]
    assert run.turns[1].completion_token_ids == second["token_ids"]
    assert run.turns[0].weight_version == "base"
    assert len(run.turns[0].completion_logprobs) == len(first["token_ids"])
    # What `trace`, `export` and `jobs` show of it: its prompt, and the job's model (opened before it was known).
    assert run.prompt == "Say a." and run.model == "tiny"
    jobs = {job.job_id: job for job in await client.list_jobs()}
    assert jobs["hud-front-job"].model == "tiny"


async def test_trace_ids_are_owned_like_runs(stack, client: Client) -> None:
    """Another team can neither read an exited trace's sample count, nor exit (record a ghost of) a rollout's
    trace, nor upload telemetry under a trace id that is not its own: RUN_NOT_OWNED, nothing stored. A recorded
    trace is never opened again, even by its own team."""
    from yieldloop.envs.letters import tasks

    a = (await client.create_api_key("hud-owner-a", "train")).api_key
    b = (await client.create_api_key("hud-owner-b", "train")).api_key
    exited = "ef" * 16
    assert (await request(stack, "POST", f"/v2/trace/{exited}/enter", a, {"task_slug": "t"}))[0] == 200
    assert (await request(stack, "POST", f"/v2/trace/{exited}/exit", a, {"reward": 1.0}))[0] == 200
    status, error = await request(stack, "POST", f"/v2/trace/{exited}/exit", b, {"reward": 0.0})
    assert status == 403 and error["error"]["code"] == "run_not_owned" and "num_samples" not in error
    status, error = await request(stack, "POST", f"/v2/trace/{exited}/enter", a, {})
    assert status == 400 and error["error"]["code"] == "trace_already_recorded"

    async with Client(**stack.addresses, api_key=a, timeout=60) as a_client:
        [run] = [r async for r in a_client.stream_rollouts(tasks("a"), group_size=1)]
    before = (await client.get_runs([run.trace_id]))[0]
    for method, path, body in [
        ("POST", f"/v2/trace/{run.trace_id}/exit", {"reward": 0.0}),
        ("POST", f"/v2/trace/{run.trace_id}/enter", {"task_slug": "ghost"}),
        ("POST", f"/v3/api/trace/{run.trace_id}/telemetry-upload", {"telemetry": [{"x": 1}]}),
        ("POST", f"/v3/api/trace/{exited}/telemetry-upload", {"telemetry": [{"x": 1}]}),
    ]:
        status, error = await request(stack, method, path, b, body)
        assert status == 403 and error["error"]["code"] == "run_not_owned", (path, error)
    assert (await client.get_runs([run.trace_id]))[0] == before, "nothing recorded over the rollout's run"
    from yieldloop_server.store import open_store

    store = open_store(stack.config.store_url)
    stored = [key for trace_id in (run.trace_id, exited) for key in store.list(f"hud/telemetry/{trace_id}/")]
    assert stored == []
    # The owner may: its telemetry is kept, its repeated exit answered from the record.
    status, done = await request(stack, "POST", f"/v2/trace/{run.trace_id}/exit", a, {"reward": 0.0})
    assert status == 200 and done["num_samples"] == len(run.turns)
    assert (await request(stack, "POST", f"/v3/api/trace/{exited}/telemetry-upload", a, {"telemetry": [{}]}))[0] == 200
    # A trace id nobody used becomes the first caller's, telemetry first or not.
    fresh = "0f" * 16
    assert (await request(stack, "POST", f"/v3/api/trace/{fresh}/telemetry-upload", a, {"telemetry": []}))[0] == 200
    status, error = await request(stack, "POST", f"/v2/trace/{fresh}/exit", b, {"reward": 1.0})
    assert status == 403 and error["error"]["code"] == "run_not_owned"
