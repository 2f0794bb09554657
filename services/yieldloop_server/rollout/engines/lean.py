"""The torch engine's forward pass for the plain Llama-shaped decoders (Llama, Qwen2): transformers' own operations
on the model's own modules' weights, in the same order, without the per-call layers around them.

At the sizes a CPU rollout samples (a small model, a batch of a few hundred rows, one token each), the wrappers a
transformers forward passes through (output capturing, config defaults, the decoder layers' checkpointing call,
attention dispatch, a model output per call) cost about as much as the arithmetic, and they hold the interpreter
lock the service's event loop needs meanwhile. The logits are the same floats transformers computes (a test
checks them bit for bit, prefill and decode, on each supported family); anything else (another architecture, a
sliding window, LoRA hooks, another activation) goes through transformers.
"""

from __future__ import annotations

from typing import Any

SUPPORTED = ("llama", "qwen2")
"""``model_type`` values whose decoder layer this module reproduces."""


def supports(model: Any) -> bool:
    """Whether :func:`forward` computes ``model``'s forward pass (a plain Llama-shaped decoder)."""
    config = model.config
    inner = getattr(model, "model", None)
    if (
        getattr(config, "model_type", "") not in SUPPORTED
        or getattr(config, "hidden_act", "") != "silu"
        or getattr(config, "pretraining_tp", 1) != 1
        or getattr(config, "mlp_bias", False)
        or any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ())
        or inner is None
        or not all(hasattr(inner, name) for name in ("embed_tokens", "rotary_emb", "norm", "layers"))
        or not hasattr(model, "lm_head")
    ):
        return False
    for layer in inner.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if (
            attn is None
            or mlp is None
            or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim"))
            or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
            or getattr(attn, "sliding_window", None)
            or not hasattr(layer.input_layernorm, "variance_epsilon")
        ):
            return False
    return True


def forward(
    model: Any, input_ids: Any, attention_mask: Any, position_ids: Any, past_key_values: Any, logits_to_keep: int = 0
) -> Any:
    """``model``'s logits (B, kept positions, vocabulary) for ``input_ids`` (B, T) at ``position_ids`` (B, T),
    attending as the 4D additive ``attention_mask`` (B, 1, T, columns) says, appending the keys and values to
    ``past_key_values`` (a transformers cache). Reads the model's modules at each call (nothing kept apart that a
    copy of the model or new weights could leave behind)."""
    from torch.nn.functional import linear, scaled_dot_product_attention, silu

    inner = model.model
    hidden = inner.embed_tokens(input_ids)
    cos, sin = inner.rotary_emb(hidden, position_ids)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    batch, length = input_ids.shape
    for index, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        residual = hidden
        hidden = _rms_norm(hidden, layer.input_layernorm)
        shape = (batch, length, -1, attn.head_dim)
        q = linear(hidden, attn.q_proj.weight, attn.q_proj.bias).view(shape).transpose(1, 2)
        k = linear(hidden, attn.k_proj.weight, attn.k_proj.bias).view(shape).transpose(1, 2)
        v = linear(hidden, attn.v_proj.weight, attn.v_proj.bias).view(shape).transpose(1, 2)
        q = (q * cos) + (_rotate_half(q) * sin)
        k = (k * cos) + (_rotate_half(k) * sin)
        k, v = past_key_values.update(k, v, index)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:  # as transformers does with a mask: the key/value heads repeated, not SDPA's GQA
            k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
        out = scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, dropout_p=0.0, scale=attn.scaling, is_causal=False
        )
        out = out.transpose(1, 2).contiguous().reshape(batch, length, -1).contiguous()
        hidden = residual + linear(out, attn.o_proj.weight, attn.o_proj.bias)
        residual = hidden
        hidden = _rms_norm(hidden, layer.post_attention_layernorm)
        gated = silu(linear(hidden, mlp.gate_proj.weight)) * linear(hidden, mlp.up_proj.weight)
        hidden = residual + linear(gated, mlp.down_proj.weight)
    if logits_to_keep:
        hidden = hidden[:, -logits_to_keep:, :]
    return linear(_rms_norm(hidden, inner.norm), model.lm_head.weight, model.lm_head.bias)


def _rms_norm(hidden: Any, norm: Any) -> Any:
    """transformers' LlamaRMSNorm / Qwen2RMSNorm, in its order: in float32, then the weight in the input's dtype."""
    import torch

    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * hidden.to(dtype)


def _rotate_half(x: Any) -> Any:
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _repeat_kv(x: Any, groups: int) -> Any:
    batch, heads, length, dim = x.shape
    return x[:, :, None, :, :].expand(batch, heads, groups, length, dim).reshape(batch, heads * groups, length, dim)
