"""Creates the tiny model offline: a BPE tokenizer trained here and a small Qwen2 model.

Nothing is downloaded. The tokenizer is trained with ``tokenizers`` on text
generated from the shipped environments' vocabulary; the model is a
``Qwen2ForCausalLM`` (head size 32, which vLLM's CPU attention backend
accepts), saved in Hugging Face format.

The weights get a brief warm-up (supervised, a few seconds on a CPU) on short
chat exchanges that echo a letter one to four times ("Say q." -> "qq"), so
the base model speaks the chat format and knows its letters, as any base
model would. The warm-up never shows the ``letters`` environment's task
prompts nor an answer of more than four letters: what that task rewards (see
``yieldloop.envs.letters``) is left for RL to find.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import random
import string
import tempfile
from collections.abc import Callable

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

TOOL_CALL_TOKENS = ["<tool_call>", "</tool_call>"]

# Qwen-style ChatML template with Hermes/Qwen tools: tool signatures in the system turn, calls as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>, results as `tool` turns. Every message is
# rendered on its own, so a conversation's text always extends its prefix's (the agent loop relies on it).
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{ '# Tools\n\nYou may call functions. Their signatures are within <tools></tools>:\n<tools>' }}"
    "{%- for tool in tools %}{{ '\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\n</tools>\n\nFor each call, return a JSON object with the function name and arguments within "
    '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-object>}'
    "\n</tool_call><|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{%- if message['role'] == 'tool' %}"
    "{{ '<|im_start|>tool\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)


@dataclasses.dataclass(frozen=True)
class TinyModelConfig:
    """Shape of the tiny model."""

    vocab_size: int = 384
    """Tokenizer vocabulary size (BPE merges stop there)."""
    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    """hidden_size / num_attention_heads = 32: the smallest head size vLLM's CPU backend takes."""
    num_key_value_heads: int = 1
    max_position_embeddings: int = 2048
    seed: int = 0
    warmup_steps: int = 150
    """Supervised warm-up steps on echo exchanges (0: random weights)."""


def _corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for letter in string.ascii_lowercase:  # no runs of one letter: "qqqq" stays four "q" tokens
        lines.append(f'Write the letter "{letter}" at least eight times.')
    words = "the a of to and in is it you that he was for on are with as his they at be this from".split()
    for _ in range(400):
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))))
        lines.append("".join(rng.choice(string.ascii_letters + string.digits + " .,") for _ in range(40)))
    for role in ("system", "user", "assistant", "tool"):
        lines.append(f"<|im_start|>{role}\nhello<|im_end|>")
    return lines


def train_tokenizer(config: TinyModelConfig):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(config.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.add_tokens(TOOL_CALL_TOKENS)  # plain added tokens: they stay in decoded text, where calls are parsed
    fast.chat_template = CHAT_TEMPLATE
    return fast


def cache_dir() -> pathlib.Path:
    """Where models built on this machine are kept: $YIELDLOOP_CACHE_DIR, else $XDG_CACHE_HOME/yieldloop, else
    ~/.cache/yieldloop."""
    if os.environ.get("YIELDLOOP_CACHE_DIR"):
        return pathlib.Path(os.environ["YIELDLOOP_CACHE_DIR"])
    return pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "yieldloop"


def recipe_key(config: TinyModelConfig) -> str:
    """What the built model depends on: this module's code, the config, and the versions of the libraries that
    build it (a change to any of them builds it again)."""
    import tokenizers
    import torch
    import transformers

    recipe = [pathlib.Path(__file__).read_text(), repr(config), torch.__version__, transformers.__version__]
    recipe.append(tokenizers.__version__)
    return hashlib.sha256("\n".join(recipe).encode()).hexdigest()[:16]


def cached_tiny_model(
    config: TinyModelConfig = TinyModelConfig(), progress: Callable[[str], None] = lambda line: None
) -> pathlib.Path:
    """The tiny model's folder in this machine's cache (:func:`cache_dir`), built there the first time (saying
    what it does through ``progress``) and reused by every data directory afterwards; a build interrupted halfway
    leaves nothing behind."""
    folder = cache_dir() / f"tiny-{recipe_key(config)}"
    if (folder / "config.json").exists():
        progress(f"the built-in tiny model from this machine's cache ({folder})")
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".building-") as tmp:
        progress(f"creating the built-in tiny model (once per machine; cached in {folder})")
        built = create_tiny_model(pathlib.Path(tmp) / "model", config, progress)
        try:
            os.rename(built, folder)  # whole or not at all; another process that built it first wins
        except OSError:
            if not (folder / "config.json").exists():
                raise
    return folder


def create_tiny_model(
    out_dir: str | pathlib.Path,
    config: TinyModelConfig = TinyModelConfig(),
    progress: Callable[[str], None] = lambda line: None,
    tokenizer=None,
    examples: Callable | None = None,
) -> pathlib.Path:
    """Writes tokenizer + a small Qwen2 model to ``out_dir`` (HF format), warmed up on ``examples`` (a function
    like :func:`warmup_examples`; default: the echo exchanges) for ``config.warmup_steps``. ``tokenizer``:
    another tokenizer than the built-in BPE one (e.g. a character tokenizer for a benchmark's task)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = pathlib.Path(out_dir)
    if tokenizer is None:
        progress("  training its tokenizer")
        tokenizer = train_tokenizer(config)
    model_config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.hidden_size // config.num_attention_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(config.seed)
    model = Qwen2ForCausalLM(model_config)
    if config.warmup_steps:
        warm_up(model, tokenizer, config, progress=progress, examples=examples or warmup_examples)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


WARMUP_PROMPTS = (
    'Say "{letter}".',
    'Type "{letter}" now.',
    'Echo "{letter}" for me.',
    'Print the letter "{letter}" please.',
    'Give me "{letter}".',
    'The letter "{letter}", and nothing else.',
    '"{letter}" is the one to say.',
    'Answer with "{letter}" and stop.',
    'Just "{letter}" on its own line.',
    'Can you say "{letter}" today?',
)
WARMUP_LENGTHS = (1, 1, 1, 1, 2, 2, 3, 4)
"""Answer lengths of the warm-up, drawn uniformly from this tuple: mostly one letter, never more than four."""


def warmup_examples(tokenizer, rng: random.Random, count: int) -> list[tuple[list[int], int]]:
    """``count`` echo exchanges as (token ids, index of the first answer token)."""
    examples = []
    for _ in range(count):
        letter = rng.choice(string.ascii_lowercase)
        prompt = rng.choice(WARMUP_PROMPTS).format(letter=letter)
        answer = letter * rng.choice(WARMUP_LENGTHS)
        messages = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        answer_ids = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        examples.append((prompt_ids + answer_ids, len(prompt_ids)))
    return examples


def warm_up(
    model,
    tokenizer,
    config: TinyModelConfig,
    batch_size: int = 32,
    learning_rate: float = 3e-3,
    progress: Callable[[str], None] = lambda line: None,
    examples: Callable = warmup_examples,
) -> None:
    """Brief supervised training on ``examples`` (default: echo exchanges; answer tokens only), in place."""
    import torch

    rng = random.Random(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    model.train()
    for step in range(config.warmup_steps):
        if step % 50 == 0:
            progress(f"  warming it up: step {step} of {config.warmup_steps}")
        batch = examples(tokenizer, rng, batch_size)
        width = max(len(ids) for ids, _ in batch)
        inputs = torch.full((batch_size, width), tokenizer.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        for row, (ids, start) in enumerate(batch):
            inputs[row, : len(ids)] = torch.tensor(ids)
            labels[row, start : len(ids)] = torch.tensor(ids[start:])
        loss = model(input_ids=inputs, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
