"""trlbench's short-episode task: a 0.5M-parameter model with a character tokenizer, short prompts, short answers.

The common shape of a small RL task: no chat template (prompts are raw text), prompts of 3-4 characters (two or
three lowercase letters and ``=``), answers of about four tokens then EOS, a binary reward. The task: answer with
the prompt's first letter written exactly four times (``"kqz="`` -> ``"kkkk"``). Training prompts and held-out
prompts start with the letters a-p; no held-out prompt is a training prompt.

The model is a Qwen2 (hidden 128, four layers, head size 32) whose tokenizer has one token per character plus EOS
and padding, warmed up (supervised, seconds on a CPU) on prompts of the same shape answered with their first letter
written one to eight times, uniformly: the base model knows which letter to write, not how many times, so about one
sampled answer in eight is right at the start, and RL has to find "four, then stop".

``env`` is the task's environment (``loadtest/shorttask.py:env`` for EnvService), ``train_tasks`` and
``heldout_tasks`` its tasksets, ``reward`` the one grading function both systems use.
"""

from __future__ import annotations

import dataclasses
import pathlib
import random
import string
from collections.abc import Sequence

from yieldloop.environment import Environment, Grade

env = Environment("short")

ANSWER_LENGTH = 4
WARMUP_LENGTHS = (1, 2, 3, 4, 5, 6, 7, 8)
"""Answer lengths of the warm-up, drawn uniformly: the right one is one in eight."""


def make_prompts(first_letters: str, count: int, seed: int, besides: Sequence[str] = ()) -> list[str]:
    """``count`` distinct prompts not in ``besides``, each a first letter from ``first_letters``, one or two more
    letters, and ``=`` (3-4 characters); first letters taken in turn so each appears about equally often."""
    rng = random.Random(seed)
    prompts: list[str] = []
    while len(prompts) < count:
        text = first_letters[len(prompts) % len(first_letters)] + _rest(rng)
        if text not in prompts and text not in besides:
            prompts.append(text)
    return prompts


def _rest(rng: random.Random) -> str:
    """What follows a prompt's first letter: one or two lowercase letters, then ``=``."""
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 2))) + "="


TRAIN_PROMPTS = make_prompts(string.ascii_lowercase[:16], 16, seed=1)
HELDOUT_PROMPTS = make_prompts(string.ascii_lowercase[:16], 32, seed=2, besides=TRAIN_PROMPTS)


def reward(answer: str, prompt: str) -> float:
    """1 when ``answer`` is the prompt's first letter written exactly four times (surrounding spaces aside), else 0."""
    return 1.0 if answer.strip() == prompt[0] * ANSWER_LENGTH else 0.0


@env.scenario()
async def first_letter(prompt: str):
    """Answer with the prompt's first letter, four times."""
    answer = yield prompt
    yield Grade(reward(answer, prompt), info={"length": len(answer)})


def train_tasks() -> list:
    return [first_letter.task(prompt=p) for p in TRAIN_PROMPTS]


def heldout_tasks() -> list:
    return [first_letter.task(prompt=p) for p in HELDOUT_PROMPTS]


TASKS = {"train_tasks": f"{__file__}:train_tasks", "heldout_tasks": f"{__file__}:heldout_tasks"}
ENV_SPEC = f"{__file__}:env"


def char_tokenizer():
    """One token per lowercase letter and ``=``, plus EOS and padding; nothing added around a sequence, no chat
    template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", "<unk>", *string.ascii_lowercase, "="])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def warmup_examples(tokenizer, rng: random.Random, count: int) -> list[tuple[list[int], int]]:
    """Prompts of the task's shape (any first letter) answered with their first letter one to eight times."""
    examples = []
    for _ in range(count):
        rest = _rest(random.Random(rng.randrange(1 << 30)))  # (a draw of its own: the benchmarked model's recipe)
        prompt = rng.choice(string.ascii_lowercase) + rest
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        answer = tokenizer.encode(prompt[0] * rng.choice(WARMUP_LENGTHS), add_special_tokens=False)
        examples.append((ids + answer + [tokenizer.eos_token_id], len(ids)))
    return examples


def build_model(out_dir: pathlib.Path) -> pathlib.Path:
    """The task's base model in ``out_dir`` (Hugging Face format)."""
    from yieldloop_server.common.tiny_model import TinyModelConfig, create_tiny_model

    config = dataclasses.replace(
        TinyModelConfig(),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=64,
        warmup_steps=300,
    )
    return create_tiny_model(out_dir, config, tokenizer=char_tokenizer(), examples=warmup_examples)
