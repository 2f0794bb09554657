"""Loading Hugging Face models safely when several threads of one process load at once.

``from_pretrained`` changes process-wide state while it runs (the default
dtype, a meta-device context), so two loads in two threads can corrupt each
other: the trainer, the rollout engine and its hot reloads share a process in
the in-process stack. Every load goes through :func:`load_causal_lm`.
"""

from __future__ import annotations

import pathlib
import threading
from typing import Any

_LOAD_LOCK = threading.Lock()


def load_causal_lm(folder: pathlib.Path, dtype: str, device: str, **kwargs: Any) -> tuple[Any, Any]:
    """Loads ``AutoModelForCausalLM`` and its tokenizer from an HF folder onto ``device``."""
    import torch
    from transformers import AutoModelForCausalLM

    with _LOAD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), **kwargs)
    return model.to(device), load_tokenizer(folder)


def import_model_code(folder: pathlib.Path) -> None:
    """Imports the transformers modules of the folder's model class (seconds the first time in a process), so
    that a later ``load_causal_lm`` of such a model in this process does not pay them."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    with _LOAD_LOCK:
        config = AutoConfig.from_pretrained(folder)
        MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)


def load_tokenizer(folder: pathlib.Path) -> Any:
    """The tokenizer of an HF folder (under the same lock)."""
    from transformers import AutoTokenizer

    with _LOAD_LOCK:
        return AutoTokenizer.from_pretrained(folder)
