"""The OpenAI-compatible endpoint, driven by the official `openai` client against the session's stack."""

from __future__ import annotations

import json

import openai
import pytest
import pytest_asyncio

from yieldloop.client import Client, sampling_params

PROMPT = [1, 40, 41, 42, 43, 44]


@pytest_asyncio.fixture(scope="module")
async def oai(client: Client):
    info = await client.get_serving_info()
    assert info.openai_base_url.startswith("http://127.0.0.1:") and info.openai_base_url.endswith("/v1")
    async with openai.AsyncOpenAI(
        base_url=info.openai_base_url, api_key=client.transport.api_key, max_retries=0
    ) as oai:
        yield oai


async def test_models(oai: openai.AsyncOpenAI, client: Client) -> None:
    models = await oai.models.list()
    # Every slug of the store is served by name (forks made by earlier tests too), the default first.
    assert models.data[0].id == "tiny"
    assert {m.id for m in models.data} == {m.slug for m in (await client.list_models())}
    assert models.data[0].model_extra["weight_version"] == (await client.get_serving_info()).weight_version


async def test_completion_returns_the_sampled_token_ids_and_logprobs(oai: openai.AsyncOpenAI, client: Client) -> None:
    completion = await oai.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=8,
        temperature=1.0,
        seed=11,
        logprobs=0,
        extra_body={"return_token_ids": True},
    )
    choice = completion.choices[0]
    token_ids = choice.model_extra["token_ids"]
    assert 1 <= len(token_ids) <= 8 and choice.model_extra["prompt_token_ids"] == PROMPT
    assert completion.usage.completion_tokens == len(token_ids) and completion.usage.prompt_tokens == len(PROMPT)
    # The same engine as gRPC Generate: same seed, same tokens and sampling logprobs.
    same = await client.generate(PROMPT, sampling=sampling_params(max_tokens=8, temperature=1.0, seed=11))
    assert same.token_ids == token_ids
    assert choice.logprobs.token_logprobs == pytest.approx(same.logprobs, abs=1e-5)
    assert choice.model_extra["weight_version"] == same.weight_version
    # ignore_eos (vLLM's extension): the whole budget, whatever the model would have ended with.
    full = await oai.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=8,
        temperature=1.0,
        seed=11,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert full.usage.completion_tokens == 8 and full.choices[0].finish_reason == "length"
    assert full.choices[0].model_extra["token_ids"][: len(token_ids)] == token_ids
    text = await oai.completions.create(model="tiny", prompt="the a of", max_tokens=4, temperature=0)
    assert text.choices[0].finish_reason in ("stop", "length") and text.model_extra["prompt_token_ids"]


async def test_chat_with_tools_renders_the_template_and_streams(oai: openai.AsyncOpenAI, tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)  # the stack's base model is made the same way
    messages = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "Write a."}]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "Looks a word up.",
                "parameters": {"type": "object", "properties": {"w": {"type": "string"}}},
            },
        }
    ]
    chat = await oai.chat.completions.create(
        model="tiny", messages=messages, tools=tools, max_tokens=6, seed=3, logprobs=True
    )
    rendered = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, return_dict=False)
    assert chat.model_extra["prompt_token_ids"] == list(rendered)
    choice = chat.choices[0]
    assert len(choice.logprobs.content) == len(choice.model_extra["token_ids"]) == chat.usage.completion_tokens
    # Streaming gives the same tokens (same seed), chunk by chunk, ending with a finish reason.
    stream = await oai.chat.completions.create(
        model="tiny", messages=messages, tools=tools, max_tokens=6, seed=3, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == choice.model_extra["token_ids"]
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == tokenizer.decode(
        choice.model_extra["token_ids"], skip_special_tokens=True
    )
    # An assistant turn with tool calls and the tool result render into the next prompt.
    follow = messages + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"w": "a"})}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "a is a letter"},
    ]
    again = await oai.chat.completions.create(model="tiny", messages=follow, tools=tools, max_tokens=2)
    prompt_text = tokenizer.decode(again.model_extra["prompt_token_ids"])
    assert '<tool_call>\n{"name": "lookup", "arguments": {"w": "a"}}\n</tool_call>' in prompt_text
    assert "<tool_response>\na is a letter\n</tool_response>" in prompt_text


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"model": "other", "prompt": PROMPT, "max_tokens": 2}, openai.NotFoundError),
        ({"model": "tiny", "prompt": PROMPT, "max_tokens": 0}, openai.BadRequestError),
        ({"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": -1}, openai.BadRequestError),
        ({"model": "tiny", "prompt": [1] * 2100, "max_tokens": 2}, openai.BadRequestError),
        ({"model": "tiny", "prompt": [1, 10**6], "max_tokens": 2}, openai.BadRequestError),
        ({"model": "tiny", "prompt": [], "max_tokens": 2}, openai.BadRequestError),
        (
            {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "extra_body": {"ignore_eos": "yes"}},
            openai.BadRequestError,
        ),
    ],
    ids=[
        "unknown-model",
        "max-tokens-zero",
        "negative-temperature",
        "prompt-too-long",
        "token-out-of-vocab",
        "empty-prompt",
        "ignore-eos-not-bool",
    ],
)
async def test_bad_input_is_an_openai_error(oai: openai.AsyncOpenAI, kwargs: dict, error: type) -> None:
    with pytest.raises(error) as err:
        await oai.completions.create(**kwargs)
    assert err.value.body["code"] and err.value.body["message"]
    assert (await oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)).choices[0].model_extra["token_ids"]


@pytest.mark.asyncio(loop_scope="session")
async def test_slow_clients_hold_nothing() -> None:
    """A header that never ends is dropped after the idle timeout; a body that never ends gets an
    OpenAI-shaped 408 (reason request_timeout) after the body timeout, and its connection closes."""
    import asyncio
    import time

    from yieldloop.transport import TransportConfig
    from yieldloop_server.rollout.openai_http import OpenAIEndpoint

    endpoint = OpenAIEndpoint(None, transport=TransportConfig(http_idle_timeout_s=0.5, http_body_timeout_s=0.5))
    base = await endpoint.start()
    host, port = base.removeprefix("http://").removesuffix("/v1").split(":")
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        start = time.monotonic()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, nothing answered
        assert 0.4 < time.monotonic() - start < 5
        writer.close()

        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"model": '
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 408") and b"Connection: close" in head
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        body = await reader.readexactly(length)
        writer.close()
        await writer.wait_closed()
        error = json.loads(body)["error"]
        assert error["code"] == "request_timeout" and "did not arrive" in error["message"]
    finally:
        await endpoint.stop()
