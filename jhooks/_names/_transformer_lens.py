"""TransformerLens' hook names on the published LLM families: `transformer_lens_names`.

One `NameMap` per family of tunix (google-tunix 0.1.7: `tunix.models.llama3`, `qwen3`,
`gemma3`), whose models are Flax NNX modules called as
`model(tokens, positions, cache, attention_mask)` on `(batch, pos)` tokens; every value
has the batch axis first, as TransformerLens' cache has. Where the model computes a value
in another layout, the entry's `read`/`write` rearrange it (`layout` says which).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._map import Name
from ._translated import NameMap


def _output(value: Any) -> Any:
    return value[1]


def _with_output(value: Any, new: Any) -> Any:
    return (value[0], new)


def _first_argument(value: Any) -> Any:
    return value[0]


def _with_first_argument(value: Any, new: Any) -> Any:
    return (new, *value[1:])


def _keys(value: Any) -> Any:
    return value[0]


def _with_keys(value: Any, new: Any) -> Any:
    return value.at[0].set(new)


def _values(value: Any) -> Any:
    return value[1]


def _with_values(value: Any, new: Any) -> Any:
    return value.at[1].set(new)


def _query_major(value: Any) -> Any:
    return value.transpose(0, 2, 1, 3)


def _with_query_major(value: Any, new: Any) -> Any:
    return new.transpose(0, 2, 1, 3)


def _grouped(value: Any) -> Any:
    b, k, g, t, s = value.shape
    return value.reshape(b, k * g, t, s)


def _with_grouped(value: Any, new: Any) -> Any:
    return new.reshape(value.shape)


BATCH_POS = "(batch, pos, d_model)"
HEADS = "(batch, pos, head, d_head)"
KV_HEADS = "(batch, pos, kv_head, d_head)"
SCORES = "(batch, head, query, key)"
RESIDUAL_IN = Name("layers.{i}:in", _first_argument, _with_first_argument, BATCH_POS)
RESIDUAL_OUT = Name("layers.{i}", _output, _with_output, BATCH_POS)


def _common(attn: str, mlp: str, ln1: str, ln2: str) -> dict[str, str | Name]:
    """The names every family maps alike; `attn` and the others are the module names."""
    return {
        "blocks.{i}.hook_resid_pre": RESIDUAL_IN,
        "blocks.{i}.hook_resid_mid": Name("layers.{i}/add", layout=BATCH_POS),
        "blocks.{i}.hook_resid_post": RESIDUAL_OUT,
        "blocks.{i}.ln1.hook_normalized": Name(f"layers.{{i}}.{ln1}", layout=BATCH_POS),
        "blocks.{i}.ln2.hook_normalized": Name(f"layers.{{i}}.{ln2}", layout=BATCH_POS),
        "blocks.{i}.attn.hook_rot_q": Name("layers.{i}.attn/concatenate", layout=HEADS),
        "blocks.{i}.attn.hook_rot_k": Name("layers.{i}.attn/concatenate:1", layout=KV_HEADS),
        "blocks.{i}.attn.hook_z": Name(f"layers.{{i}}.attn.{attn}:in", layout=HEADS),
        "blocks.{i}.mlp.hook_pre": Name("layers.{i}.mlp.gate_proj", layout="(batch, pos, d_mlp)"),
        "blocks.{i}.mlp.hook_pre_linear": Name(
            "layers.{i}.mlp.up_proj", layout="(batch, pos, d_mlp)"
        ),
        "blocks.{i}.mlp.hook_post": Name(
            "layers.{i}.mlp.down_proj:in", layout="(batch, pos, d_mlp)"
        ),
        "blocks.{i}.hook_mlp_out": Name(f"layers.{{i}}.{mlp}", layout=BATCH_POS),
        "ln_final.hook_normalized": Name("final_norm", layout=BATCH_POS),
    }


def _llama_like(
    read: Callable[[Any], Any] | None = None, write: Callable[[Any, Any], Any] | None = None
) -> dict[str, str | Name]:
    """Llama 3's names, with the scores and pattern read by `read` (Qwen 3's grouped)."""
    return {
        "hook_embed": Name("embedder.encode", layout=BATCH_POS),
        **_common("o_proj", "mlp", "input_layernorm", "post_attention_layernorm"),
        "blocks.{i}.attn.hook_q": Name("layers.{i}.attn.q_proj", layout=HEADS),
        "blocks.{i}.attn.hook_k": Name("layers.{i}.attn.k_proj", layout=KV_HEADS),
        "blocks.{i}.attn.hook_v": Name("layers.{i}.attn.v_proj", layout=KV_HEADS),
        "blocks.{i}.attn.hook_attn_scores": Name("layers.{i}.attn/where", read, write, SCORES),
        "blocks.{i}.attn.hook_pattern": Name("layers.{i}.attn/softmax", read, write, SCORES),
        "blocks.{i}.hook_attn_out": Name("layers.{i}.attn", _output, _with_output, BATCH_POS),
    }


_GEMMA3 = {
    # The embedding times sqrt(d_model) (what tunix's `Embedder.encode` returns), as
    # TransformerLens folds the scale into W_E.
    "hook_embed": Name("embedder.encode", layout=BATCH_POS),
    **_common("attn_vec_einsum", "post_ffw_norm", "pre_attention_norm", "pre_ffw_norm"),
    "blocks.{i}.attn.hook_q": Name("layers.{i}.attn.q_einsum", layout=HEADS),
    "blocks.{i}.attn.hook_k": Name("layers.{i}.attn.kv_einsum", _keys, _with_keys, KV_HEADS),
    "blocks.{i}.attn.hook_v": Name("layers.{i}.attn.kv_einsum", _values, _with_values, KV_HEADS),
    "blocks.{i}.attn.hook_attn_scores": Name(
        "layers.{i}.attn/where", _query_major, _with_query_major, SCORES
    ),
    "blocks.{i}.attn.hook_pattern": Name(
        "layers.{i}.attn/softmax", _query_major, _with_query_major, SCORES
    ),
    # What is added to the residual stream: after the post-attention norm, as in
    # TransformerLens' Gemma blocks.
    "blocks.{i}.hook_attn_out": Name("layers.{i}.post_attention_norm", layout=BATCH_POS),
}

_MAPS: dict[str, NameMap] = {
    "llama3": NameMap(_llama_like(), "llama3"),
    "qwen3": NameMap(_llama_like(_grouped, _with_grouped), "qwen3"),
    "gemma3": NameMap(_GEMMA3, "gemma3"),
}


def transformer_lens_names(family: str) -> NameMap:
    """TransformerLens' hook names on a published model family, as a [`jhooks.NameMap`][].

    **Arguments:**

    - `family`: `"llama3"`, `"qwen3"` or `"gemma3"`: tunix's `Llama3`, `Qwen3` and
        `Gemma3` (google-tunix 0.1.7, Flax NNX, made hookable with
        [`jhooks.hookable`][]), called as `model(tokens, positions, cache, mask)`.

    **Returns:**

    The family's map: `hook_embed`, `blocks.{i}.hook_resid_pre` / `_mid` / `_post`,
    `blocks.{i}.ln1.hook_normalized` / `ln2`, `blocks.{i}.attn.hook_q` / `hook_k` /
    `hook_v` / `hook_rot_q` / `hook_rot_k` / `hook_attn_scores` / `hook_pattern` /
    `hook_z`, `blocks.{i}.hook_attn_out`, `blocks.{i}.mlp.hook_pre` / `hook_pre_linear` /
    `hook_post`, `blocks.{i}.hook_mlp_out` and `ln_final.hook_normalized`, each value in
    TransformerLens' layout with the batch axis first (see [Hooking a model you did not
    write](other_models.md#transformerlens-names) for what each stands for). Extend it
    with `|`.

    **Example:**

    ```python
    tl = jhooks.transformer_lens_names("llama3")
    _, cache = tl.run_with_cache(model, tokens, positions, None, mask,
                                 names_filter="blocks.*.attn.hook_pattern")
    cache["blocks.0.attn.hook_pattern"]     # (batch, head, query, key)
    ```
    """
    if family not in _MAPS:
        raise ValueError(
            f"transformer_lens_names: no map for the family {family!r}; the families: "
            f"{', '.join(repr(f) for f in _MAPS)} (or write one: jhooks.NameMap)."
        )
    return _MAPS[family]
