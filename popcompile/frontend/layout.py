"""A checkpoint whose weights are not the layout its family's code reads is refused, never run.

transformers builds a model from ``config.json`` and then fills it from the checkpoint: a parameter the
checkpoint lacks is left at its random initialisation (a warning), a tensor the code does not read is
dropped (a warning). Both mean a model other than the one named: a fused ``qkv_proj`` in a Llama folder
leaves q/k/v random, attention sinks in a family without them are never added. POP would prune and serve
that model as if it were the checkpoint's, so loading stops here with what differs and what to do::

    from_pretrained(..., output_loading_info=True) -> missing, unexpected, mismatched keys
    check_layout(...)                                -> UnsupportedModelError, one line, when any is there

The same holds for the config: a setting that changes what a layer computes (``UNREAD_SETTINGS``), in a
config.json whose family's config class does not define it, is a variant the family's code would ignore
(a chunked attention mask on a Llama, Granite's multipliers on a Mistral): ``check_settings`` refuses it
before any weight is read.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..errors import UnsupportedModelError

_SHOWN = 2  # keys named in the message; the rest counted

#: config settings some family's code reads and others' ignore: name -> (what it is, the value that changes
#: nothing)
UNREAD_SETTINGS: dict[str, tuple[str, object]] = {
    "attention_chunk_size": ("a chunked attention mask", None),
    "no_rope_layers": ("layers without RoPE", None),
    "attn_logit_softcapping": ("soft-capped attention scores", None),
    "final_logit_softcapping": ("soft-capped logits", None),
    "logits_scaling": ("scaled logits", 1.0),
    "embedding_multiplier": ("a scaled embedding", 1.0),
    "residual_multiplier": ("a scaled residual", 1.0),
    "attention_multiplier": ("an attention scale", None),
    "clip_qkv": ("clamped q/k/v projections", None),
    "use_qk_norm": ("q/k norms", False),
}


def check_settings(config, name: str) -> None:
    """UnsupportedModelError where ``config`` (a decoder's; a vision-language model's text config) sets one of
    ``UNREAD_SETTINGS`` its family's config class does not define: the family's code would not apply it."""
    defaults = type(config)()
    for setting, (what, neutral) in UNREAD_SETTINGS.items():
        value = getattr(config, setting, neutral)
        if not hasattr(defaults, setting) and value is not None and value != neutral:
            raise UnsupportedModelError(
                f"model {name!r} sets {setting}={value!r} ({what}), which transformers' "
                f"{config.model_type!r} code does not read: it would run without it; use a family whose code "
                "applies it (docs/families.md), or remove the setting if the weights were made without it")


def check_layout(folder: Path, model_type: str | None, *, missing: Iterable[str] = (),
                 unexpected: Iterable[str] = (), mismatched: Iterable = ()) -> None:
    """UnsupportedModelError unless the checkpoint in ``folder`` holds exactly the weights of its family's
    code: ``missing`` (parameters it lacks), ``unexpected`` (tensors the code does not read),
    ``mismatched`` (``(key, checkpoint shape, model shape)``: a shape the config does not give)."""
    found = [(what, sorted(str(k if isinstance(k, str) else k[0]) for k in keys))
             for what, keys in (("lacks", missing), ("has weights the code does not read:", unexpected),
                                ("has weights of another shape:", mismatched))]
    found = [(what, keys) for what, keys in found if keys]
    if not found:
        return
    said = "; ".join(f"{what} {_named(keys)}" for what, keys in found)
    raise UnsupportedModelError(
        f"the checkpoint in {folder} is not transformers' {model_type!r} layout (it {said}): loading would "
        "run random or missing weights; save the model in its family's layout (transformers' "
        "save_pretrained of the loaded model), or use the model_type that matches its weights")


def _named(keys: list[str]) -> str:
    shown = ", ".join(keys[:_SHOWN])
    return shown if len(keys) <= _SHOWN else f"{shown} (+{len(keys) - _SHOWN} more)"
