"""Weight conversion: ``torch.nn.Transformer``, HF transformers and timm state dicts -> specvit state dicts.

:func:`convert_state_dict` reads the spec's structure (model kind, stacks, depth, block layers, head) and
looks up, for every parameter the compiled model has, the source keys it comes from and how to combine
them (fused ``qkv`` from separate q/k/v, ``q`` and ``kv`` sliced out of a packed ``in_proj``, GPT-2's
(in, out) ``Conv1D`` weights transposed, (N, D) position tables given a batch dim). Every source key must
be used, or be a known non-parameter buffer (HF's causal-mask ``attn.bias`` / ``attn.masked_bias`` and
``position_ids`` / ``token_type_ids``); anything else is an error, so no real parameter is dropped.

What a state dict cannot show must be right in the spec: the number of heads, norm eps, activation, the
norm placement of a ``torch.nn.Transformer`` and the pooling of a timm model.

Supported sources:

- ``torch``: ``torch.nn.TransformerEncoder`` (``layers.i.*``, ``norm``) for ``model: encoder`` specs and
  ``torch.nn.Transformer`` (``encoder.*``, ``decoder.*``) for ``model: encoder_decoder`` specs.
- ``hf``: ``ViTModel`` / ``ViTForImageClassification`` (image encoders; keys with or without ``vit.``,
  transformers 5 names or the older ``encoder.layer.i.attention.attention.query`` names of Hub
  checkpoints), ``BertModel`` (token encoders; with or without ``bert.``) and ``GPT2LMHeadModel`` /
  ``GPT2Model`` (token decoders; with or without ``transformer.``).
- ``timm``: every model class :func:`specvit.from_timm` reads (``specvit/interop/timm_*.py``), found by
  the state dict's keys: ``VisionTransformer`` (class and register tokens, learned positions with or
  without the prefix, ``norm_pre``, layer scale, QK-norm, ``fc_norm``, packed or split gated MLPs),
  ``SwinTransformer``, and the families listed by ``TIMM_FAMILIES``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from specvit import argcheck
from specvit.interop.hf import hf_layouts
from specvit.interop.layout import (
    Entry,
    Layout,
    Misfit,
    check_blocks,
    one,
    rows,
)
from specvit.interop.registry import FAMILIES
from specvit.interop.timm import timm_layouts
from specvit.spec.schema import Spec

__all__ = ["Source", "convert_state_dict"]

Source = Literal["torch", "hf", "timm"]

_SHOWN = 20  # keys listed per kind of problem in an error message


def _torch(spec: Spec, keys: Sequence[str]) -> Layout:
    if spec.model == "encoder":
        name, roots = "torch.nn.TransformerEncoder", {"encoder": ""}
    elif spec.model == "encoder_decoder":
        name, roots = "torch.nn.Transformer", {"encoder": "encoder.", "decoder": "decoder."}
    else:
        raise ValueError(
            "source 'torch' converts torch.nn.TransformerEncoder (model: encoder) and torch.nn.Transformer "
            f"(model: encoder_decoder) state dicts; spec {spec.name!r} is a {spec.model} model"
        )
    allowed: dict[str, list[tuple[str, ...]]] = {
        "encoder": [("self_attention", "mlp")],
        "decoder": [
            ("masked_self_attention", "cross_attention", "mlp"),
            ("self_attention", "cross_attention", "mlp"),
        ],
    }
    table: dict[str, Entry] = {}
    for role, root in roots.items():
        stack = check_blocks(spec, role, name, allowed[role])
        block, layer = role + ".blocks.{i}.", root + "layers.{i}."
        for k in range(1, len(stack.block.layers) + 1):
            table[block + f"norm{k}" + ".{p}"] = one(layer + f"norm{k}" + ".{p}")
        table[block + "attn.qkv.{p}"] = one(layer + "self_attn.in_proj_{p}")
        table[block + "attn.proj.{p}"] = one(layer + "self_attn.out_proj.{p}")
        if role == "decoder":
            q_rows = stack.facts.heads * stack.facts.head_dim  # in_proj packs [q; k; v]
            table[block + "cross_attn.q.{p}"] = one(layer + "multihead_attn.in_proj_{p}", rows(0, q_rows))
            table[block + "cross_attn.kv.{p}"] = one(layer + "multihead_attn.in_proj_{p}", rows(q_rows, None))
            table[block + "cross_attn.proj.{p}"] = one(layer + "multihead_attn.out_proj.{p}")
        table[block + "mlp.fc1.{p}"] = one(layer + "linear1.{p}")
        table[block + "mlp.fc2.{p}"] = one(layer + "linear2.{p}")
        table[role + ".norm.{p}"] = one(root + "norm.{p}")
    return Layout(name, table)


def _no_hf(spec: Spec, keys: Sequence[str]) -> Layout:
    families = ", ".join(f.name for f in FAMILIES)
    raise ValueError(f"source 'hf' converts state dicts of {families}; these keys are none of them")


_LAYOUTS: dict[str, Callable[[Sequence[str]], list[Callable[[Spec, Sequence[str]], Layout]]]] = {
    "torch": lambda keys: [_torch],
    "hf": lambda keys: hf_layouts(keys) or [_no_hf],
    "timm": timm_layouts,
}
"""Per source: the layouts that may name a state dict with these keys, tried in order."""


# -- conversion ---------------------------------------------------------------------------------------


def _expected(spec: Spec) -> dict[str, tuple[int, ...]]:
    """Key -> shape of every entry of the state dict of the model built from ``spec`` (built on meta)."""
    from specvit.compile import build_model

    model = build_model(spec, device="meta")
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _listing(title: str, items: Sequence[str]) -> str:
    more = f", ... ({len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
    return f"\n  {title} ({len(items)}): " + ", ".join(items[:_SHOWN]) + more


def convert_state_dict(state_dict: Mapping[str, Tensor], source: Source, spec: Spec) -> dict[str, Tensor]:
    """Rename and repack a foreign state dict into the state dict of the model built from ``spec``.

    Args:
        state_dict: the source model's ``state_dict()`` (or a checkpoint of it).
        source: ``torch`` (``torch.nn.Transformer`` / ``TransformerEncoder``), ``hf`` (transformers ViT,
            BERT, GPT-2, chosen by the spec's model kind and input) or ``timm`` (``VisionTransformer``).
        spec: the spec describing the same architecture as the source model.

    Returns:
        A state dict that ``build_model(spec).load_state_dict(out, strict=True)`` accepts. Tensors keep
        their dtype and device; some share memory with ``state_dict``.

    Raises:
        ValueError: if the spec's structure has no counterpart in the source format, or the state dict
            does not match it: every missing or unexpected source key, spec parameter without a source,
            shape mismatch and untied copy of a tied head is named.
        TypeError: ``state_dict`` is not a mapping of names to tensors, or ``spec`` is not a Spec.
    """
    if not isinstance(source, str) or source not in _LAYOUTS:
        raise ValueError(f"source must be one of {sorted(_LAYOUTS)}, got {source!r:.80}")
    if not isinstance(spec, Spec):
        raise TypeError(
            f"spec must be a Spec, got {type(spec).__name__}; pass specvit.load_spec(...) of a spec file or preset"
        )
    argcheck.tensors(state_dict, "state_dict")
    keys = list(state_dict)
    expected = _expected(spec)
    failures: list[ValueError] = []
    misfits: list[Misfit] = []
    for layout in _LAYOUTS[source](keys):  # most specific first; the first that maps every key wins
        try:
            return _convert(state_dict, layout(spec, keys), expected, spec)
        except Misfit as exc:  # the layout's names mean other modules in this spec: said only if none fits
            misfits.append(exc)
        except ValueError as exc:
            failures.append(exc)
    raise (failures or misfits)[0]


def _convert(
    state_dict: Mapping[str, Tensor], layout: Layout, expected: dict[str, tuple[int, ...]], spec: Spec
) -> dict[str, Tensor]:
    """``state_dict`` renamed by one layout; raises ValueError naming every key it cannot place."""
    keys = list(state_dict)
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    missing: dict[str, None] = {}  # ordered set
    unmapped: list[str] = []
    mismatched: list[str] = []
    for target, shape in expected.items():
        entry = layout.sources(target)
        if entry is None:
            unmapped.append(target)
            continue
        names, transform = entry
        used.update(names)
        absent = [n for n in names if n not in state_dict]
        if absent:
            missing.update(dict.fromkeys(absent))
            continue
        got = [state_dict[n] for n in names]
        try:
            tensor = transform(got)
        except (RuntimeError, IndexError) as exc:
            shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(names, got, strict=True))
            mismatched.append(f"{target} cannot be made from {shapes} ({exc})")
            continue
        if tuple(tensor.shape) != shape:
            mismatched.append(f"{target} needs {shape}, got {tuple(tensor.shape)} from {', '.join(names)}")
            continue
        out[target] = tensor
    buffers = _buffer_problems(layout, state_dict, used)
    unexpected = [k for k in keys if k not in used and not layout.ignored(k)]
    problems = [
        _listing("missing source keys", list(missing)) if missing else "",
        _listing("unexpected source keys", unexpected) if unexpected else "",
        _listing(f"spec parameters with no {layout.name} counterpart", unmapped) if unmapped else "",
        _listing("shape mismatches", mismatched) if mismatched else "",
        *buffers,
    ]
    if any(problems):
        raise ValueError(
            f"cannot convert a {layout.name} state dict for spec {spec.name!r}:" + "".join(problems)
        )
    return out


def _buffer_problems(layout: Layout, state_dict: Mapping[str, Tensor], used: set[str]) -> list[str]:
    """The source keys the spec checks rather than loads (a tied head's copy, zero buffers, frozen tables),
    marked used; the listings of those that do not hold what the spec assumes."""
    untied = []
    for key, twin in layout.tied.items():
        if key in state_dict:
            used.add(key)
            if twin in state_dict and not torch.equal(state_dict[key], state_dict[twin]):
                untied.append(f"{key} differs from {twin}")
    nonzero = []
    for key, fix in layout.zeros.items():
        if key in state_dict:
            used.add(key)
            if torch.count_nonzero(state_dict[key]):
                nonzero.append(f"{key} ({fix})")
    unequal = []
    for key, want in layout.fixed.items():
        if key in state_dict:
            used.add(key)
            stored = state_dict[key].detach()
            value = stored.float().cpu()
            table = want(tuple(value.shape)) if callable(want) else want
            # a table stored in half precision (as checkpoints are published) holds the values rounded
            atol = max(1e-5, torch.finfo(stored.dtype).eps) if stored.is_floating_point() else 1e-5
            if value.shape != table.shape or not torch.allclose(value, table, rtol=0.0, atol=atol):
                unequal.append(key)
    return [
        _listing("tied copies that differ (the spec ties the LM head)", untied) if untied else "",
        _listing("nonzero buffers the spec has no place for", nonzero) if nonzero else "",
        _listing("frozen tables unlike the ones the spec computes", unequal) if unequal else "",
    ]
