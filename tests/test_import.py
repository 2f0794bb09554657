"""Models you bring: importing Hugging Face folders and cached hub ids (not the built-in model), checked, recorded
and committed as a base slug; a stack started on one serves and trains it; bad sources fail typed, writing nothing."""

from __future__ import annotations

import hashlib
import pathlib

import pytest
from test_training_safety import good_batch

from yieldloop import errors
from yieldloop.client import Client, sampling_params
from yieldloop.envs.letters import tasks
from yieldloop_server.config import EnvOptions, RolloutOptions, StackConfig
from yieldloop_server.stack import InProcessStack
from yieldloop_server.store import open_store


def build_llama(
    folder: pathlib.Path, *, chat_template: bool = True, safetensors: bool = True, num_hidden_layers: int = 2
) -> pathlib.Path:
    """A small Llama (not the built-in Qwen2) in Hugging Face format, made offline: head size 32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from yieldloop_server.common.tiny_model import TinyModelConfig, train_tokenizer

    tokenizer = train_tokenizer(TinyModelConfig())
    if not chat_template:
        tokenizer.chat_template = None
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(1)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    if not safetensors:  # the older PyTorch format (transformers now writes safetensors only)
        (folder / "model.safetensors").unlink()
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return build_llama(tmp_path_factory.mktemp("src") / "tiny-llama")


def _sha(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _keys(stack, slug: str) -> list[str]:
    return list(open_store(stack.config.store_url).list(f"models/{slug}/"))


async def test_import_records_the_model_and_stores_safetensors_as_they_are(stack, client: Client, llama) -> None:
    done = await client.import_model(str(llama), "imported-llama", owner="team-a")
    model = done.model
    assert (model.slug, model.base, model.owner, model.source) == (
        "imported-llama",
        "imported-llama",
        "team-a",
        str(llama),
    )
    assert model.architecture == "LlamaForCausalLM" and model.dtype == "float32" and model.has_chat_template
    assert model.num_parameters == sum(p.numel() for p in _load(llama).parameters())
    assert done.head.checkpoint_id == "base" and done.head.sequence == 1
    manifest = await client.get_checkpoint("imported-llama", "base")
    by_name = {o.name: o for o in manifest.objects}
    assert by_name["model.safetensors"].sha256 == _sha(llama / "model.safetensors")  # the same bytes
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(by_name)
    assert model.size_bytes == sum(o.size for o in manifest.objects)
    listed = {m.slug: m for m in (await client.list_models())}
    assert listed["imported-llama"].architecture == "LlamaForCausalLM"
    assert listed["tiny"].architecture == "Qwen2ForCausalLM" and listed["tiny"].source == "built-in"
    forked = await client.fork_model("imported-llama", "imported-llama-fork")
    assert forked.model.architecture == "LlamaForCausalLM" and forked.model.parent == "imported-llama"


def _load(folder: pathlib.Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder)


async def test_import_without_chat_template_from_pytorch_weights_and_from_the_hub_cache(
    stack, client: Client, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = build_llama(tmp_path / "plain", chat_template=False, safetensors=False)
    assert not list(plain.glob("*.safetensors")) and list(plain.glob("pytorch_model*.bin"))
    done = await client.import_model(str(plain), "plain-llama")
    assert not done.model.has_chat_template and done.model.architecture == "LlamaForCausalLM"
    names = {o.name for o in (await client.get_checkpoint("plain-llama", "base")).objects}
    assert "model.safetensors" in names and not any(n.endswith(".bin") for n in names)  # converted once

    # A hub id already in the local Hugging Face cache (its standard layout), offline.
    cache = tmp_path / "hf-cache"
    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = cache / "models--acme--tiny-llama" / "snapshots" / revision
    build_llama(snapshot)
    (cache / "models--acme--tiny-llama" / "refs").mkdir()
    (cache / "models--acme--tiny-llama" / "refs" / "main").write_text(revision)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    done = await client.import_model("acme/tiny-llama", "hub-llama")
    assert done.model.source == "acme/tiny-llama" and done.model.architecture == "LlamaForCausalLM"


@pytest.mark.parametrize(
    "case", ["no-weights", "no-tokenizer", "no-config", "wrong-shape", "unknown-hub-id", "slug-exists", "invalid-slug"]
)
async def test_bad_imports_fail_typed_and_write_nothing(
    stack, client: Client, llama, tmp_path: pathlib.Path, case: str
) -> None:
    import shutil

    source, name = tmp_path / "bad", f"bad-{case}"
    shutil.copytree(llama, source)
    expected: tuple[type, str] = (errors.InvalidArgumentError, "MODEL_SOURCE_INVALID")
    if case == "no-weights":
        (source / "model.safetensors").unlink()
    elif case == "no-tokenizer":
        for path in source.glob("tokenizer*"):
            path.unlink()
    elif case == "no-config":
        (source / "config.json").unlink()
    elif case == "wrong-shape":
        text = (source / "config.json").read_text().replace('"intermediate_size": 128', '"intermediate_size": 96')
        (source / "config.json").write_text(text)
    elif case == "unknown-hub-id":
        source, expected = "nobody/nothing-here", (errors.NotFoundError, "MODEL_SOURCE_NOT_FOUND")
    elif case == "slug-exists":
        name, expected = "tiny", (errors.AlreadyExistsError, "MODEL_ALREADY_EXISTS")
    elif case == "invalid-slug":
        name, expected = "../escape", (errors.InvalidArgumentError, "INVALID_FIELD")
    before = {m.slug: m for m in (await client.list_models())}
    with pytest.raises(expected[0]) as err:
        await client.import_model(str(source), name)
    assert err.value.reason == expected[1], err.value
    assert {m.slug: m for m in (await client.list_models())} == before
    if case not in ("invalid-slug", "slug-exists"):
        assert _keys(stack, name) == []  # nothing written for a failed import


async def test_a_stack_started_on_a_folder_imports_serves_and_trains_it(tmp_path_factory, llama) -> None:
    data_dir = tmp_path_factory.mktemp("llama-stack")
    stack = InProcessStack(StackConfig(data_dir=data_dir, model=str(llama), env=EnvOptions(workers=0)))
    await stack.start()
    try:
        assert stack.config.model == "tiny-llama"  # the slug is named after the folder
        async with Client(**stack.addresses, api_key=stack.api_key, timeout=120) as client:
            completion = await client.generate([1, 40, 41, 42], sampling=sampling_params(max_tokens=6, ignore_eos=True))
            assert len(completion.token_ids) == 6 and completion.weight_version == "base"
            runs = [run async for run in client.stream_rollouts(tasks("ab"), group_size=2)]
            assert all(run.model == "tiny-llama" for run in runs)
            await client.forward_backward(runs=runs)
            step = await client.optim_step(1e-3)
            info = await client.get_serving_info(wait_for_checkpoint_id=step.checkpoint.checkpoint_id)
            assert info.weight_version == step.checkpoint.checkpoint_id
            assert (await client.get_head("tiny-llama")).checkpoint_id == step.checkpoint.checkpoint_id
    finally:
        await stack.stop()
    # A later start finds the slug it imported instead of importing again.
    again = InProcessStack(StackConfig(data_dir=data_dir, model=str(llama), env=EnvOptions(workers=0)))
    await again.start()
    try:
        async with Client(**again.addresses, api_key=again.api_key, timeout=60) as client:
            assert (await client.get_head("tiny-llama")).checkpoint_id == step.checkpoint.checkpoint_id
    finally:
        await again.stop()


async def test_an_unknown_model_is_an_error_naming_what_exists(tmp_path: pathlib.Path) -> None:
    stack = InProcessStack(StackConfig(data_dir=tmp_path, model="no-such-model", env=EnvOptions(workers=0)))
    with pytest.raises(errors.NotFoundError) as err:
        await stack.start()
    assert err.value.reason == "MODEL_NOT_FOUND" and "it has: none" in err.value.message
    assert not any((tmp_path / "store").rglob("model.json"))  # no model quietly created under that name


async def test_a_model_without_chat_template_rolls_out_raw_text(tmp_path_factory) -> None:
    """A base model whose tokenizer has no chat template: episodes give it the prompt as raw text (recorded in
    the Run); chat requests are a typed error, not an INTERNAL one from transformers."""
    import aiohttp

    from yieldloop.types import PromptFormat, RunStatus

    folder = build_llama(tmp_path_factory.mktemp("src") / "plain-base", chat_template=False)
    stack = InProcessStack(
        StackConfig(data_dir=tmp_path_factory.mktemp("plain-stack"), model=str(folder), env=EnvOptions(workers=0))
    )
    await stack.start()
    try:
        async with Client(**stack.addresses, api_key=stack.api_key, timeout=120) as client:
            runs = [run async for run in client.stream_rollouts(tasks("ab"), group_size=2)]
            assert all(r.status == RunStatus.GRADED and r.prompt_format == PromptFormat.RAW for r in runs)
            assert all(len(r.turns) == 1 for r in runs)
            with pytest.raises(errors.InvalidArgumentError) as err:
                await client.generate(messages=[{"role": "user", "content": "hi"}])
            assert err.value.reason == "NO_CHAT_TEMPLATE"
            completion = await client.generate([1, 40, 41], sampling=sampling_params(max_tokens=3, ignore_eos=True))
            assert len(completion.token_ids) == 3
            base_url = (await client.get_serving_info()).openai_base_url
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {client.transport.api_key}"}) as http:
            body = {"model": "plain-base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            async with http.post(f"{base_url}/chat/completions", json=body) as response:
                assert response.status == 400
                assert (await response.json())["error"]["code"] == "no_chat_template"
            async with http.post(
                f"{base_url}/completions", json={"model": "plain-base", "prompt": "40 + 2 =", "max_tokens": 4}
            ) as response:
                assert response.status == 200
    finally:
        await stack.stop()


async def test_the_rollout_memory_budget_unloads_idle_models_and_refuses_one_too_large(tmp_path_factory) -> None:
    data_dir = tmp_path_factory.mktemp("budget-stack")
    stack = InProcessStack(StackConfig(data_dir=data_dir, env=EnvOptions(workers=0)))
    await stack.start()
    try:
        async with Client(**stack.addresses, api_key=stack.api_key, timeout=120) as client:
            tiny = next(m for m in (await client.list_models()) if m.slug == "tiny")
            big = build_llama(tmp_path_factory.mktemp("src") / "big-llama", num_hidden_layers=8)
            await client.import_model(str(big), "big-llama")
            await client.fork_model("tiny", "budget-fork")
    finally:
        await stack.stop()
    # Room for one tiny-sized model's weights (and at most four engines by count).
    budget = StackConfig(
        data_dir=data_dir, env=EnvOptions(workers=0), rollout=RolloutOptions(max_models=4, memory_budget_mb=1)
    )
    assert tiny.size_bytes < 1_000_000 < 2 * tiny.size_bytes
    stack = InProcessStack(budget)
    await stack.start()
    try:
        async with Client(**stack.addresses, api_key=stack.api_key, timeout=120) as client:
            fork = await client.generate([1, 40, 41], model="budget-fork", sampling=sampling_params(max_tokens=2))
            again = await client.generate([1, 40, 41], sampling=sampling_params(max_tokens=2))  # the default, reloaded
            assert fork.weight_version and again.weight_version
            with pytest.raises(errors.ResourceExhaustedError) as err:
                await client.generate([1, 40, 41], model="big-llama", sampling=sampling_params(max_tokens=2))
            assert err.value.reason == "MODEL_TOO_LARGE" and "big-llama" in err.value.message
            # The refusal unloaded nothing: the default still serves, and is the only model loaded.
            assert (await client.generate([1, 40, 41], sampling=sampling_params(max_tokens=2))).weight_version
            base_url = (await client.get_serving_info()).openai_base_url
        import aiohttp

        async with (
            aiohttp.ClientSession(headers={"Authorization": f"Bearer {client.transport.api_key}"}) as http,
            http.get(f"{base_url}/models") as response,
        ):
            loaded = {card["id"] for card in (await response.json())["data"] if card["weight_version"]}
        assert loaded == {"tiny"}  # budget-fork was unloaded to make room
    finally:
        await stack.stop()


async def _import_on_server(client: Client, source: str, name: str) -> errors.YieldloopError | None:
    """ImportModel of a path on the service's machine, as a remote caller would send it."""
    try:
        await client.import_model(source, name, on_server=True)
    except errors.YieldloopError as err:
        return err
    return None


async def test_nobody_imports_what_is_not_theirs(tmp_path_factory, llama) -> None:
    """Another team's private weights in the stack's own folders (the rollout's download of them) cannot be
    imported: a team key never names a path on the service's machine (ROLE_NOT_ALLOWED, and nothing is read:
    a path that does not exist answers the same); an admin key only under the operator's import roots, resolved
    first (a symlink out of a root, or a root holding the data directory, are refused: IMPORT_PATH_REFUSED). A
    team uploads its own folder instead, its files checked against their sha256."""
    import os
    import shutil

    data_dir = tmp_path_factory.mktemp("imports")
    roots = tmp_path_factory.mktemp("import-root")
    shutil.copytree(llama, roots / "allowed")
    from yieldloop_server.config import CheckpointOptions

    stack = InProcessStack(
        StackConfig(
            data_dir=data_dir,
            env=EnvOptions(workers=0),
            checkpoint=CheckpointOptions(import_roots=(str(roots), str(data_dir))),
        )
    )
    await stack.start()
    try:
        async with Client(**stack.addresses, api_key=stack.api_key, timeout=120) as admin:
            victim = (await admin.create_api_key("victim", "train")).api_key
            thief = (await admin.create_api_key("thief", "train")).api_key
            async with Client(**stack.addresses, api_key=victim, timeout=120) as v:
                await v.fork_model("tiny", "victim-private")
                await v.forward_backward(datums=good_batch(1), model="victim-private")
                step = await v.optim_step(1e-2, model="victim-private")
                await v.get_serving_info(wait_for_checkpoint_id=step.checkpoint.checkpoint_id, model="victim-private")
            downloaded = data_dir / "work" / "rollout" / "victim-private" / step.checkpoint.checkpoint_id
            assert downloaded.is_dir()
            async with Client(**stack.addresses, api_key=thief, timeout=120) as t:
                for path in (downloaded, data_dir / "no-such-folder", roots / "allowed"):
                    err = await _import_on_server(t, str(path), "stolen")
                    assert isinstance(err, errors.PermissionDeniedError) and err.reason == "ROLE_NOT_ALLOWED", err
                    assert "upload" in err.message and "config.json" not in err.message
                # Its own folder, uploaded: fine, and its own.
                mine = await t.import_model(str(llama), "thief-own")
                assert mine.model.owner == "thief" and mine.model.source == str(llama)
            # Admin keys: only under a root, never the stack's own folders, symlinks resolved first.
            os.symlink(downloaded, roots / "link-into-data")
            for path, reason in (
                (downloaded, "IMPORT_PATH_REFUSED"),
                (roots / "link-into-data", "IMPORT_PATH_REFUSED"),
                (roots / ".." / "elsewhere", "IMPORT_PATH_REFUSED"),
                (llama, "IMPORT_PATH_REFUSED"),
            ):
                err = await _import_on_server(admin, str(path), "by-path")
                assert isinstance(err, errors.PermissionDeniedError) and err.reason == reason, (path, err)
            assert await _import_on_server(admin, str(roots / "allowed"), "by-path") is None
            assert (await admin.get_model("by-path")).source == str(roots / "allowed")
            assert "stolen" not in {m.slug for m in (await admin.list_models())}
    finally:
        await stack.stop()


async def test_an_upload_is_checked_file_by_file(stack, client: Client, llama) -> None:
    """Bytes that do not match their declared sha256 are DATA_LOSS naming the file, fewer bytes than declared or
    a file name that is a path are INVALID_ARGUMENT; nothing is written for any of them."""
    from yieldloop._status import error_from_rpc
    from yieldloop.proto.checkpoint.v1 import checkpoint_service_pb2 as pb
    from yieldloop.wire.uploads import upload_header, upload_requests

    header = upload_header(llama, "upload-checked")

    async def send(requests) -> errors.YieldloopError:
        try:
            await client.raw.checkpoint.UploadModel(iter(list(requests)), timeout=60)
        except Exception as err:
            return error_from_rpc(err)
        raise AssertionError("accepted")

    forged = pb.UploadModelHeader()
    forged.CopyFrom(header)
    forged.files[0].sha256 = "0" * 64
    err = await send(upload_requests(llama, forged))
    assert isinstance(err, errors.DataLossError) and forged.files[0].name in err.message
    short = list(upload_requests(llama, header))[:-1]
    err = await send(short)
    assert isinstance(err, errors.InvalidArgumentError) and err.field == "chunk"
    for name in ("../escape.json", "sub/dir.json", "notes.exe"):
        evil = pb.UploadModelHeader(name="upload-evil", files=[pb.UploadedFile(name=name, size=0, sha256="0" * 64)])
        err = await send([pb.UploadModelRequest(header=evil)])
        assert isinstance(err, errors.InvalidArgumentError) and err.field == "header.files[0].name", err
    listed = {m.slug for m in (await client.list_models())}
    assert not {"upload-checked", "upload-evil"} & listed
    assert _keys(stack, "upload-checked") == [] and _keys(stack, "upload-evil") == []
