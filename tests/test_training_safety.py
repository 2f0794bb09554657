"""Training safety: nothing non-finite is trained on, committed or served; a step is all or nothing, compare-
and-swap on the head, and idempotent under retries (issue 14)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random

import pytest
import pytest_asyncio

from yieldloop import errors
from yieldloop.client import Client
from yieldloop.transport import TransportConfig
from yieldloop.types import Datum


class Faults:
    """A server interceptor failing chosen calls: before the handler runs, or after it ran (the answer lost)."""

    def __init__(self) -> None:
        self.plan: dict[str, list[str]] = {}
        self.serving: dict[str, set[asyncio.Task]] = {}
        self._cut: set[asyncio.Task] = set()

    def inject(self, method: str, *modes: str) -> None:
        self.plan.setdefault(method, []).extend(modes)

    def cut(self, method: str) -> None:
        """Fails the calls of ``method`` in progress, UNAVAILABLE (a service going down drops its streams)."""
        for task in self.serving.get(method, ()):
            self._cut.add(task)
            task.cancel()

    @contextlib.asynccontextmanager
    async def intercept(self, call):
        method = call.method.rsplit("/", 1)[-1]
        queue = self.plan.get(method)
        mode = queue.pop(0) if queue else ""
        if mode == "before":
            raise errors.UnavailableError("injected failure before the call ran", reason="INTERNAL")
        serving, me = self.serving.setdefault(method, set()), asyncio.current_task()
        serving.add(me)
        try:
            yield
        except asyncio.CancelledError:
            if me not in self._cut:
                raise
            self._cut.discard(me)
            me.uncancel()
            raise errors.UnavailableError("injected outage: the stream was dropped", reason="INTERNAL") from None
        finally:
            serving.discard(me)
        if mode == "after":
            raise errors.UnavailableError("injected failure: the call ran, its answer was lost", reason="INTERNAL")


@pytest.fixture(scope="module")
def faults() -> Faults:
    return Faults()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def safety_stack(tmp_path_factory, faults):
    from yieldloop_server.config import StackConfig, TrainerOptions
    from yieldloop_server.stack import InProcessStack

    config = StackConfig(
        data_dir=tmp_path_factory.mktemp("safety"),
        trainer=TrainerOptions(max_models=8),
        transport=TransportConfig(server_interceptors=(faults,)),
    )
    stack = InProcessStack(config)
    await stack.start()
    yield stack
    await stack.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def sc(safety_stack):
    # No retries of repeatable calls: these tests look at each failure the client would otherwise retry.
    async with Client(**safety_stack.addresses, api_key=safety_stack.api_key, timeout=120, retry_within_s=0) as client:
        yield client


def good_batch(seed: int = 0, vocab: int = 300) -> list[Datum]:
    from test_trainer import random_datums

    return random_datums(random.Random(seed), (9, 12), vocab, lowest=1)


async def fingerprint(client: Client, model: str) -> list[list[float]]:
    """The learner's logprobs on a fixed batch: equal before and after only if the weights are."""
    return await client.forward(datums=good_batch(99), model=model)


async def weights_sha(client: Client, model: str, checkpoint_id: str) -> str:
    manifest = await client.get_checkpoint(model, checkpoint_id)
    return next(o.sha256 for o in manifest.objects if o.name == "model.safetensors")


@pytest.mark.parametrize(
    "adam",
    [
        {"learning_rate": math.inf},
        {"learning_rate": math.nan},
        {"learning_rate": -1.0},
        {"learning_rate": 1e-3, "eps": math.nan},
        {"learning_rate": 1e-3, "weight_decay": math.nan},
        {"learning_rate": 1e-3, "weight_decay": math.inf},
        {"learning_rate": 1e-3, "max_grad_norm": math.nan},
        {"learning_rate": 1e-3, "max_grad_norm": math.inf},
        {"learning_rate": 1e-3, "beta1": math.nan},
        {"learning_rate": 1e-3, "beta2": 1.0},
    ],
)
async def test_bad_hyperparameters_are_invalid_and_change_nothing(sc: Client, adam) -> None:
    await sc.forward_backward(datums=good_batch(), loss_fn="cross_entropy")
    head, before = await sc.get_head("tiny"), await fingerprint(sc, "tiny")
    pending = (await sc.get_trainer_info()).num_pending_datums
    with pytest.raises(errors.InvalidArgumentError) as err:
        await sc.optim_step(**adam)
    assert err.value.reason == "INVALID_FIELD" and err.value.field.startswith("adam."), err.value
    assert (await sc.get_head("tiny")) == head and await fingerprint(sc, "tiny") == before
    assert (await sc.get_trainer_info()).num_pending_datums == pending


@pytest.mark.parametrize(
    "loss_fn, knobs",
    [
        ("dro", {"beta": math.inf}),
        ("dro", {"beta": math.nan}),
        ("ppo", {"clip_low_threshold": math.nan}),
        ("ppo", {"clip_low_threshold": 2.0, "clip_high_threshold": 1.0}),
        ("cispo", {"clip_high_threshold": -1.0}),
    ],
)
async def test_bad_loss_knobs_are_invalid(sc: Client, loss_fn, knobs) -> None:
    with pytest.raises(errors.InvalidArgumentError) as err:
        await sc.forward_backward(datums=good_batch(), loss_fn=loss_fn, loss_fn_config=knobs)
    assert err.value.reason == "INVALID_FIELD" and "loss_fn_config" in err.value.field


async def test_poisoned_batches_are_refused_and_leave_the_gradients_as_they_were(sc: Client) -> None:
    """A good batch, then poisoned ones (refused, NON_FINITE), then the step: its checkpoint is byte for byte the
    one a twin fork commits from the good batch alone."""
    for name in ("poisoned", "twin"):
        await sc.fork_model("tiny", name)
    for name in ("poisoned", "twin"):
        await sc.forward_backward(datums=good_batch(1), model=name)
    extreme = good_batch(2)
    extreme[0].sampling_logprobs = [-1e4] * len(extreme[0].sampling_logprobs)  # finite, but exp(lp - q) = inf
    huge = good_batch(3)
    huge[1].weights = [3e38] * len(huge[1].weights)
    poisons = [
        sc.forward_backward(datums=extreme, model="poisoned"),
        sc.forward_backward(datums=extreme, model="poisoned", loss_fn="ppo"),
        sc.backward(huge, model="poisoned"),
    ]
    for poison in poisons:
        with pytest.raises(errors.InvalidArgumentError) as err:
            await poison
        assert err.value.reason == "NON_FINITE", err.value
    assert (await sc.get_trainer_info(model="poisoned")).num_pending_datums == 2
    steps = {name: (await sc.optim_step(1e-2, model=name)).checkpoint.checkpoint_id for name in ("poisoned", "twin")}
    assert await weights_sha(sc, "poisoned", steps["poisoned"]) == await weights_sha(sc, "twin", steps["twin"])
    served = await sc.get_serving_info(wait_for_checkpoint_id=steps["poisoned"], model="poisoned")
    assert not served.last_reload_error


async def test_a_failed_commit_leaves_the_trainer_as_before_and_a_retry_commits_once(sc: Client, faults) -> None:
    await sc.fork_model("tiny", "flaky")
    await sc.forward_backward(datums=good_batch(4), model="flaky")
    head, before = await sc.get_head("flaky"), await fingerprint(sc, "flaky")

    faults.inject("CommitCheckpoint", "before")  # the checkpoint service refuses: nothing committed
    with pytest.raises(errors.UnavailableError):
        await sc.optim_step(1e-2, model="flaky", idempotency_key="step-A")
    assert await sc.get_head("flaky") == head and await fingerprint(sc, "flaky") == before
    info = await sc.get_trainer_info(model="flaky")
    assert (info.num_pending_datums, info.step) == (2, 0)  # gradients and step as before

    faults.inject("CommitCheckpoint", "after")  # committed, but the trainer hears an error
    with pytest.raises(errors.UnavailableError):
        await sc.optim_step(1e-2, model="flaky", idempotency_key="step-A")
    retried = await sc.optim_step(1e-2, model="flaky", idempotency_key="step-A")
    again = await sc.optim_step(1e-2, model="flaky", idempotency_key="step-A")
    assert retried.checkpoint.checkpoint_id == again.checkpoint.checkpoint_id
    tree = await sc.list_checkpoints("flaky")
    assert [c.step for c in tree] == [0, 1] and tree[-1].checkpoint_id == retried.checkpoint.checkpoint_id
    assert (await sc.get_trainer_info(model="flaky")).num_pending_datums == 0  # applied once, in that step
    assert await fingerprint(sc, "flaky") != before


async def test_two_trainers_racing_on_one_model_one_step_per_parent(sc: Client) -> None:
    """An operator's rollback (or another trainer's step) between ForwardBackward and OptimStep: the step is
    ABORTED/HEAD_CONFLICT, not a silent sibling head; the loser's gradients are intact."""
    await sc.fork_model("tiny", "raced")
    await sc.forward_backward(datums=good_batch(5), model="raced")
    first = (await sc.optim_step(1e-2, model="raced")).checkpoint.checkpoint_id
    await sc.forward_backward(datums=good_batch(6), model="raced")
    await sc.set_head("raced", "base")  # moved under the trainer while gradients are pending
    with pytest.raises(errors.AbortedError) as err:
        await sc.optim_step(1e-2, model="raced")
    assert err.value.reason == "HEAD_CONFLICT"
    assert (await sc.get_head("raced")).checkpoint_id == "base"
    assert [c.checkpoint_id for c in (await sc.list_checkpoints("raced"))] == ["base", first]
    info = await sc.get_trainer_info(model="raced")
    assert (info.num_pending_datums, info.step) == (2, 1)
    # The way out the error names: discard the stale gradients; the next call trains from the new head.
    assert "DiscardGradients" in err.value.message and "discard-gradients" in err.value.message
    assert await sc.discard_gradients("raced") == 2
    await sc.forward_backward(datums=good_batch(7), model="raced")
    step = await sc.optim_step(1e-2, model="raced")
    assert (
        step.parent_checkpoint_id == "base"
        and (await sc.get_head("raced")).checkpoint_id == step.checkpoint.checkpoint_id
    )


async def test_one_callers_overflowing_datum_spoils_no_one_elses_gradients(sc: Client) -> None:
    """Two clients share a session: one's datum is finite but its advantage (1e38) overflows the accumulated
    gradient. It is refused at ForwardBackward (NON_FINITE, naming the field), the accumulation stays exactly as
    it was, and the other client's step commits the same bytes as a twin that never saw the poison. A request
    that overflows only in sum with what is already accumulated is refused the same way."""
    for name in ("shared", "shared-twin"):
        await sc.fork_model("tiny", name)
    for name in ("shared", "shared-twin"):
        await sc.forward_backward(datums=good_batch(11), model=name)
    overflow = good_batch(12)
    overflow[0].advantages = [0.0] * 3 + [1e38] * (len(overflow[0].advantages) - 3)
    big = good_batch(13)
    big[1].advantages = [0.0] * 3 + [1e19] * (len(big[1].advantages) - 3)  # alone finite, norm finite in fp32
    for poison in (overflow, big, big):
        with pytest.raises(errors.InvalidArgumentError) as err:
            await sc.forward_backward(datums=poison, model="shared")
        assert err.value.reason == "NON_FINITE" and err.value.field == "items", err.value
    assert (await sc.get_trainer_info(model="shared")).num_pending_datums == 2
    steps = {
        name: (await sc.optim_step(1e-2, model=name)).checkpoint.checkpoint_id for name in ("shared", "shared-twin")
    }
    assert await weights_sha(sc, "shared", steps["shared"]) == await weights_sha(
        sc, "shared-twin", steps["shared-twin"]
    )


async def test_discard_gradients_after_a_refused_step(sc: Client) -> None:
    """A step refused as NON_FINITE keeps the gradients and says how to drop them; DiscardGradients does, and
    another team cannot discard this team's."""
    await sc.fork_model("tiny", "discarded")
    assert await sc.discard_gradients("discarded") == 0
    await sc.forward_backward(datums=good_batch(14), model="discarded")
    await sc.forward_backward(datums=good_batch(15), model="discarded")
    assert await sc.discard_gradients("discarded") == 4
    with pytest.raises(errors.FailedPreconditionError) as err:
        await sc.optim_step(1e-2, model="discarded")
    assert err.value.reason == "NO_GRADIENTS"
    assert (await sc.get_trainer_info(model="discarded")).num_pending_datums == 0


async def test_the_rollout_refuses_non_finite_weights(sc: Client, safety_stack, tmp_path) -> None:
    """A checkpoint with a NaN weight (committed by hand, checksums correct) is never served: the previous
    weights keep serving, the refusal shows in GetServingInfo and the weights health."""
    from safetensors.torch import load_file, save_file

    from yieldloop.types import Manifest
    from yieldloop_server.store import open_store
    from yieldloop_server.weights.files import download_verified, upload_folder

    await sc.fork_model("tiny", "nan-model")
    await sc.get_serving_info(wait_for_checkpoint_id="base", model="nan-model")  # served before the bad step
    store = open_store(safety_stack.config.store_url)
    base = await sc.get_checkpoint("nan-model", "base")
    folder = download_verified(store, base, tmp_path / "base")
    weights = load_file(folder / "model.safetensors")
    name = next(iter(weights))
    weights[name][0] = float("nan")
    poisoned = tmp_path / "poisoned"
    poisoned.mkdir()
    for path in folder.iterdir():
        (poisoned / path.name).write_bytes(path.read_bytes())
    save_file(weights, poisoned / "model.safetensors", metadata={"format": "pt"})
    objects = upload_folder(store, "nan-model", "nan-step", poisoned)
    await sc.commit_checkpoint(Manifest("nan-model", "nan-step", objects, parent_checkpoint_id="base"), set_head=True)

    with pytest.raises(errors.FailedPreconditionError) as err:
        await sc.get_serving_info(wait_for_checkpoint_id="nan-step", model="nan-model")
    assert "NaN" in str(err.value)
    info = await sc.get_serving_info(model="nan-model")
    assert info.weight_version == "base" and "NaN or inf" in info.last_reload_error
    done = await sc.generate([1, 40, 41], model="nan-model")
    assert done.weight_version == "base" and all(math.isfinite(x) for x in done.logprobs)
    # The trainer refuses to load it too.
    with pytest.raises(errors.FailedPreconditionError) as trained:
        await sc.forward_backward(datums=good_batch(), model="nan-model")
    assert trained.value.reason == "NON_FINITE"


@pytest.mark.parametrize(
    "outage",
    [
        OSError("injected: disk unreadable"),
        TimeoutError("injected: store timeout"),
        PermissionError("injected: access denied"),
    ],
)
async def test_the_rollout_keeps_following_the_head_through_store_errors(sc: Client, monkeypatch, outage) -> None:
    """The store fails reads of the model's HEAD for two seconds (the WatchHead stream and GetHead answer errors
    other than UNAVAILABLE): the rollout shows it is not following, retries with backoff, and then serves the
    head that moved during the outage."""
    import time

    from yieldloop_server.store.fs import FsStore

    slug = f"followed-{type(outage).__name__.lower()}"
    await sc.fork_model("tiny", slug)
    await sc.get_serving_info(wait_for_checkpoint_id="base", model=slug)
    assert (await sc.get_serving_info(model=slug)).following
    await sc.forward_backward(datums=good_batch(7), model=slug)
    real = FsStore.get_bytes
    until = time.monotonic() + 2.0

    def failing(self, key: str):
        if key == f"models/{slug}/HEAD" and time.monotonic() < until:
            raise outage
        return real(self, key)

    monkeypatch.setattr(FsStore, "get_bytes", failing)
    for _ in range(150):
        info = await sc.get_serving_info(model=slug)
        if not info.following:
            break
        await asyncio.sleep(0.02)
    assert not info.following and info.follow_error, info
    while time.monotonic() < until:
        await asyncio.sleep(0.05)
    moved = (await sc.optim_step(1e-2, model=slug)).checkpoint.checkpoint_id
    info = await sc.get_serving_info(wait_for_checkpoint_id=moved, model=slug, timeout=60)
    assert info.weight_version == moved and info.following and not info.follow_error


@pytest.mark.parametrize(
    "options, field",
    [
        ({"group_size": 2**31 - 1}, "group_size"),
        ({"group_size": 5000}, "group_size"),
        ({"max_attempts": 1_000_000}, "max_attempts"),
        ({"max_steps": 100_000}, "max_steps"),
    ],
)
async def test_fan_out_is_bounded(sc: Client, options, field) -> None:
    from yieldloop.envs.letters import tasks

    with pytest.raises(errors.InvalidArgumentError) as err:
        [run async for run in sc.stream_rollouts(tasks("ab"), **{"group_size": 1, **options})]
    assert err.value.field == field and "at most" in err.value.message, err.value


async def test_infrastructure_retries_back_off_within_a_budget(sc: Client, faults) -> None:
    """EnvService refuses the first episodes: they are retried after a backoff and complete. When it refuses
    everything, the request's retry budget bounds the extra load, and every run says INFRA_ERROR."""
    import time

    from yieldloop.envs.letters import tasks
    from yieldloop.types import RunStatus

    # RolloutService runs its episodes over a shared StreamEpisodes stream: a refused stream fails the episodes
    # on it, and their retries open a new one.
    faults.inject("StreamEpisodes", "before", "before")  # a short outage: two refusals
    start = time.monotonic()
    runs = [run async for run in sc.stream_rollouts(tasks("a"), group_size=1)]
    assert runs[0].status == RunStatus.GRADED and runs[0].attempts == 3
    assert time.monotonic() - start >= 0.2 * 0.5 + 0.4 * 0.5  # two backoffs (jitter at most halves each)

    faults.inject("StreamEpisodes", *["before"] * 500)  # down for good: its open stream goes too
    faults.cut("StreamEpisodes")
    runs = [run async for run in sc.stream_rollouts(tasks("abcd"), group_size=8, max_attempts=10)]
    faults.plan["StreamEpisodes"].clear()
    assert len(runs) == 32 and {run.status for run in runs} == {RunStatus.INFRA_ERROR}
    assert sum(run.attempts for run in runs) <= 32 + 8  # one attempt each plus the budget of 8 retries
    assert any("retry budget" in run.error for run in runs)


def test_a_step_that_makes_weights_non_finite_is_reverted(tiny_model_dir) -> None:
    """The last line of defence, exercised by an optimizer that writes NaN: a revocable step (one that will be
    committed) is reverted exactly; a step that commits nothing keeps no copy and marks the trainer spoiled
    (its session reloads the last checkpoint)."""
    import torch

    from yieldloop_server.trainer.trainer import AdamConfig, Trainer

    trainer = Trainer(tiny_model_dir)
    trainer.forward_backward(good_batch(8, trainer.vocab_size), "importance_sampling", {})
    before = [p.detach().clone() for p in trainer.model.parameters()]
    grads = [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]
    real_step = trainer.optimizer.step

    def poisoned_step():
        real_step()
        next(iter(trainer.model.parameters())).data[0] = float("nan")

    trainer.optimizer.step = poisoned_step
    with pytest.raises(errors.FailedPreconditionError) as err:
        trainer.optim_step(AdamConfig(1e-3), revocable=True)
    assert err.value.reason == "NON_FINITE" and "reverted" in str(err.value)
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    assert all(
        torch.equal(a, p.grad)
        for a, p in zip(grads, [p for p in trainer.model.parameters() if p.grad is not None], strict=True)
    )
    assert (trainer.step, trainer.num_pending_datums, trainer.spoiled) == (0, 2, False)
    with pytest.raises(errors.FailedPreconditionError):
        trainer.optim_step(AdamConfig(1e-3))
    assert trainer.spoiled
