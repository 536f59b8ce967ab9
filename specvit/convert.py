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
- ``timm``: ``VisionTransformer`` with pre-norm ``Block``s: class and register tokens, learned positions
  with or without the prefix (``no_embed_class``), ``norm_pre``, layer scale, QK-norm, ``fc_norm`` and
  packed (``SwiGLUPacked``, gate first) or split (``SwiGLU``) gated MLPs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from specvit.spec.schema import ImageInput, LMHead, Spec, StackSpec, TokensInput

__all__ = ["Source", "convert_state_dict"]

Source = Literal["torch", "hf", "timm"]
Transform = Callable[[Sequence[Tensor]], Tensor]
Entry = tuple[tuple[str, ...], Transform]  # source key templates, and how to make the target from them

_SHOWN = 20  # keys listed per kind of problem in an error message
_BLOCK = re.compile(r"\.blocks\.(\d+)\.")


# -- transforms ---------------------------------------------------------------------------------------


def _same(ts: Sequence[Tensor]) -> Tensor:
    return ts[0]


def _cat(ts: Sequence[Tensor]) -> Tensor:
    return torch.cat(tuple(ts), dim=0)  # separate q, k, v (or gate, value) -> one packed projection


def _conv1d(ts: Sequence[Tensor]) -> Tensor:
    """GPT-2's ``Conv1D`` stores weights as (in, out); ``nn.Linear`` wants (out, in). Biases pass through."""
    return ts[0].t().contiguous() if ts[0].ndim == 2 else ts[0]


def _batched(ts: Sequence[Tensor]) -> Tensor:
    return ts[0].unsqueeze(0)  # (N, D) position table -> (1, N, D)


def _patches(ts: Sequence[Tensor]) -> Tensor:
    """A Conv2d patch weight (D, C, ph, pw) as the equivalent Linear weight (D, C*ph*pw); biases pass."""
    return ts[0].flatten(1) if ts[0].ndim == 4 else ts[0]


def _rows(start: int, stop: int | None) -> Transform:
    """Rows ``start:stop`` of a packed projection, e.g. ``q`` or ``kv`` out of an ``in_proj``."""

    def take(ts: Sequence[Tensor]) -> Tensor:
        return ts[0][start:stop]

    return take


def _one(source: str, transform: Transform = _same) -> Entry:
    return (source,), transform


# -- layouts ------------------------------------------------------------------------------------------


@dataclass
class _Layout:
    """How one source format names the parameters of a spec's model.

    Args:
        name: the source format, for messages.
        table: target key template -> source key templates and transform. ``{i}`` stands for a block
            index and ``{p}`` for a parameter name; a template without ``{p}`` names one parameter.
        ignore: regular expressions of source keys that are buffers, not parameters.
        tied: source key -> the source key it must equal; dropped (a tied head's copy of the embedding).
    """

    name: str
    table: dict[str, Entry]
    ignore: tuple[str, ...] = ()
    tied: dict[str, str] = field(default_factory=dict)

    def sources(self, target: str) -> Entry | None:
        """The source keys of one target key and their transform, or None if the format has no such part."""
        match = _BLOCK.search(target)
        index = match.group(1) if match else ""
        generic = _BLOCK.sub(".blocks.{i}.", target, count=1)
        module, _, param = generic.rpartition(".")
        entry = self.table.get(generic)
        if entry is None:
            entry = self.table.get(module + ".{p}")
        if entry is None:
            return None
        templates, transform = entry
        return tuple(t.format(i=index, p=param) for t in templates), transform

    def ignored(self, key: str) -> bool:
        return any(re.fullmatch(pattern, key) for pattern in self.ignore)


def _check_blocks(
    spec: Spec, role: str, source: str, layers: Iterable[tuple[str, ...]], placement: str | None = None
) -> StackSpec:
    """The stack ``role`` of ``spec``, after checking that its blocks have a layout ``source`` can hold.

    Args:
        spec: the target spec.
        role: ``encoder`` or ``decoder``.
        source: the source format, for messages.
        layers: the sublayer orders the format's blocks can have.
        placement: the norm placement of the format's blocks, or None when the weights fit either.
    """
    stack = spec.stacks[role]
    allowed = list(layers)
    if tuple(stack.block.layers) not in allowed:
        shown = " or ".join(str(list(a)) for a in allowed)
        raise ValueError(
            f"{source} blocks have the sublayers {shown}, but spec {spec.name!r} has "
            f"{role}.block.layers {list(stack.block.layers)}"
        )
    if placement is not None and stack.block.norm.placement != placement:
        raise ValueError(
            f"{source} blocks are {placement}-norm, but spec {spec.name!r} has "
            f"{role}.block.norm.placement {stack.block.norm.placement}"
        )
    return stack


def _prefix(keys: Iterable[str], prefix: str) -> str:
    """``prefix`` if any key starts with it (a task model's backbone), else the empty string."""
    return prefix if any(k.startswith(prefix) for k in keys) else ""


def _torch(spec: Spec, keys: Sequence[str]) -> _Layout:
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
        stack = _check_blocks(spec, role, name, allowed[role])
        block, layer = role + ".blocks.{i}.", root + "layers.{i}."
        for k in range(1, len(stack.block.layers) + 1):
            table[block + f"norm{k}" + ".{p}"] = _one(layer + f"norm{k}" + ".{p}")
        table[block + "attn.qkv.{p}"] = _one(layer + "self_attn.in_proj_{p}")
        table[block + "attn.proj.{p}"] = _one(layer + "self_attn.out_proj.{p}")
        if role == "decoder":
            q_rows = stack.heads * stack.head_dim  # in_proj packs [q; k; v]
            table[block + "cross_attn.q.{p}"] = _one(layer + "multihead_attn.in_proj_{p}", _rows(0, q_rows))
            table[block + "cross_attn.kv.{p}"] = _one(
                layer + "multihead_attn.in_proj_{p}", _rows(q_rows, None)
            )
            table[block + "cross_attn.proj.{p}"] = _one(layer + "multihead_attn.out_proj.{p}")
        table[block + "mlp.fc1.{p}"] = _one(layer + "linear1.{p}")
        table[block + "mlp.fc2.{p}"] = _one(layer + "linear2.{p}")
        table[role + ".norm.{p}"] = _one(root + "norm.{p}")
    return _Layout(name, table)


def _hf_vit(spec: Spec, keys: Sequence[str]) -> _Layout:
    name = "HF ViTModel / ViTForImageClassification"
    stack = _check_blocks(spec, "encoder", name, [("self_attention", "mlp")], "pre")
    pre = _prefix(keys, "vit.")
    legacy = any(k.startswith(pre + "encoder.layer.") for k in keys)  # transformers 4 / Hub checkpoint names
    layer = pre + ("encoder.layer.{i}." if legacy else "layers.{i}.")
    if legacy:
        qkv = tuple(layer + f"attention.attention.{n}" + ".{p}" for n in ("query", "key", "value"))
        proj, fc1, fc2 = "attention.output.dense", "intermediate.dense", "output.dense"
    else:
        qkv = tuple(layer + f"attention.{n}_proj" + ".{p}" for n in "qkv")
        proj, fc1, fc2 = "attention.o_proj", "mlp.fc1", "mlp.fc2"
    assert isinstance(stack.input, ImageInput)
    patch = _patches if stack.input.projection == "linear" else _same
    block = "encoder.blocks.{i}."
    return _Layout(
        name,
        {
            "encoder.patch_embed.proj.{p}": _one(pre + "embeddings.patch_embeddings.projection.{p}", patch),
            "encoder.prefix.cls_token": _one(pre + "embeddings.cls_token"),
            "encoder.pos_embed.weight": _one(pre + "embeddings.position_embeddings"),
            block + "norm1.{p}": _one(layer + "layernorm_before.{p}"),
            block + "attn.qkv.{p}": (qkv, _cat),
            block + "attn.proj.{p}": _one(layer + proj + ".{p}"),
            block + "norm2.{p}": _one(layer + "layernorm_after.{p}"),
            block + "mlp.fc1.{p}": _one(layer + fc1 + ".{p}"),
            block + "mlp.fc2.{p}": _one(layer + fc2 + ".{p}"),
            "encoder.norm.{p}": _one(pre + "layernorm.{p}"),
            "head.fc.{p}": _one("classifier.{p}"),
        },
    )


def _hf_bert(spec: Spec, keys: Sequence[str]) -> _Layout:
    _check_blocks(spec, "encoder", "HF BertModel", [("self_attention", "mlp")], "post")
    pre = _prefix(keys, "bert.")
    layer, block = pre + "encoder.layer.{i}.", "encoder.blocks.{i}."
    qkv = tuple(layer + f"attention.self.{n}" + ".{p}" for n in ("query", "key", "value"))
    return _Layout(
        "HF BertModel",
        {
            "encoder.tok_embed.{p}": _one(pre + "embeddings.word_embeddings.{p}"),
            "encoder.type_embed.{p}": _one(pre + "embeddings.token_type_embeddings.{p}"),
            "encoder.pos_embed.weight": _one(pre + "embeddings.position_embeddings.weight", _batched),
            "encoder.embed_norm.{p}": _one(pre + "embeddings.LayerNorm.{p}"),
            block + "attn.qkv.{p}": (qkv, _cat),
            block + "attn.proj.{p}": _one(layer + "attention.output.dense.{p}"),
            block + "norm1.{p}": _one(layer + "attention.output.LayerNorm.{p}"),
            block + "mlp.fc1.{p}": _one(layer + "intermediate.dense.{p}"),
            block + "mlp.fc2.{p}": _one(layer + "output.dense.{p}"),
            block + "norm2.{p}": _one(layer + "output.LayerNorm.{p}"),
        },
        ignore=(re.escape(pre) + r"embeddings\.(?:position_ids|token_type_ids)",),
    )


def _hf_gpt2(spec: Spec, keys: Sequence[str]) -> _Layout:
    _check_blocks(spec, "decoder", "HF GPT2LMHeadModel", [("masked_self_attention", "mlp")], "pre")
    pre = _prefix(keys, "transformer.")
    layer, block = pre + "h.{i}.", "decoder.blocks.{i}."
    table = {
        "decoder.tok_embed.{p}": _one(pre + "wte.{p}"),
        "decoder.pos_embed.weight": _one(pre + "wpe.weight", _batched),
        block + "norm1.{p}": _one(layer + "ln_1.{p}"),
        block + "attn.qkv.{p}": _one(layer + "attn.c_attn.{p}", _conv1d),
        block + "attn.proj.{p}": _one(layer + "attn.c_proj.{p}", _conv1d),
        block + "norm2.{p}": _one(layer + "ln_2.{p}"),
        block + "mlp.fc1.{p}": _one(layer + "mlp.c_fc.{p}", _conv1d),
        block + "mlp.fc2.{p}": _one(layer + "mlp.c_proj.{p}", _conv1d),
        "decoder.norm.{p}": _one(pre + "ln_f.{p}"),
    }
    tied = {}
    if isinstance(spec.head, LMHead) and spec.head.tied:
        tied["lm_head.weight"] = pre + "wte.weight"
    else:
        table["head.fc.{p}"] = _one("lm_head.{p}")
    return _Layout(
        "HF GPT2LMHeadModel",
        table,
        ignore=(re.escape(pre) + r"h\.\d+\.attn\.(?:bias|masked_bias)",),  # causal-mask buffers
        tied=tied,
    )


def _hf(spec: Spec, keys: Sequence[str]) -> _Layout:
    stack = spec.stacks[spec.output_stack]
    if spec.model == "encoder" and isinstance(stack.input, ImageInput):
        return _hf_vit(spec, keys)
    if spec.model == "encoder" and isinstance(stack.input, TokensInput):
        return _hf_bert(spec, keys)
    if spec.model == "decoder" and isinstance(stack.input, TokensInput):
        return _hf_gpt2(spec, keys)
    raise ValueError(
        "source 'hf' converts ViT (image encoder), BERT (token encoder) and GPT-2 (token decoder) state "
        f"dicts; spec {spec.name!r} is a {spec.model} model reading {stack.input.kind}"
    )


def _timm_swin(spec: Spec, stack: StackSpec) -> _Layout:
    """timm's SwinTransformer (>= 0.9 layout: patch merging at the start of stages 1..)."""
    name = "timm SwinTransformer"
    _check_blocks(spec, "encoder", name, [("self_attention", "mlp")], "pre")
    table: dict[str, Entry] = {
        "encoder.patch_embed.proj.{p}": _one("patch_embed.proj.{p}"),
        "encoder.embed_norm.{p}": _one("patch_embed.norm.{p}"),
        "encoder.norm.{p}": _one("norm.{p}"),
        "head.fc.{p}": _one("head.fc.{p}"),
    }
    for s in range(len(stack.stage_depths)):
        ours, theirs = f"encoder.stages.{s}.", f"layers.{s}."
        for part in ("downsample.norm", "downsample.reduction"):
            table[ours + part + ".{p}"] = _one(theirs + part + ".{p}")
        for part in ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2"):
            table[ours + "blocks.{i}." + part + ".{p}"] = _one(theirs + "blocks.{i}." + part + ".{p}")
        table[ours + "blocks.{i}.attn.relative_position_bias_table"] = _one(
            theirs + "blocks.{i}.attn.relative_position_bias_table"
        )
    # buffers some timm versions save: derived from the window size, recomputed by specvit
    ignore = (
        r"layers\.\d+\.blocks\.\d+\.attn\.relative_position_index",
        r"layers\.\d+\.blocks\.\d+\.attn_mask",
    )
    return _Layout(name, table, ignore)


def _timm(spec: Spec, keys: Sequence[str]) -> _Layout:
    name = "timm VisionTransformer"
    stack = spec.stacks[spec.output_stack]
    if spec.model == "encoder" and stack.hierarchical:
        return _timm_swin(spec, stack)
    if spec.model != "encoder" or not isinstance(stack.input, ImageInput):
        raise ValueError(
            f"source 'timm' converts VisionTransformer state dicts (image encoders); spec {spec.name!r} is "
            f"a {spec.model} model reading {stack.input.kind}"
        )
    _check_blocks(spec, "encoder", name, [("self_attention", "mlp")], "pre")
    block, layer = "encoder.blocks.{i}.", "blocks.{i}."
    if any(re.fullmatch(r"blocks\.\d+\.mlp\.fc1_g\.weight", k) for k in keys):  # SwiGLU: split gate/value
        fc1: Entry = ((layer + "mlp.fc1_g.{p}", layer + "mlp.fc1_x.{p}"), _cat)
    else:
        fc1 = _one(layer + "mlp.fc1.{p}")
    patch = _patches if stack.input.projection == "linear" else _same
    table = {
        "encoder.patch_embed.proj.{p}": _one("patch_embed.proj.{p}", patch),
        "encoder.prefix.cls_token": _one("cls_token"),
        "encoder.prefix.reg_token": _one("reg_token"),
        "encoder.pos_embed.weight": _one("pos_embed"),
        "encoder.embed_norm.{p}": _one("norm_pre.{p}"),
        block + "mlp.fc1.{p}": fc1,
        "encoder.norm.{p}": _one("norm.{p}"),
        "head.norm.{p}": _one("fc_norm.{p}"),
        "head.fc.{p}": _one("head.{p}"),
    }
    for part in (
        "norm1",
        "attn.qkv",
        "attn.q_norm",
        "attn.k_norm",
        "attn.proj",
        "ls1",
        "norm2",
        "mlp.fc2",
        "ls2",
    ):
        table[block + part + ".{p}"] = _one(layer + part + ".{p}")  # timm names these as specvit does
    return _Layout(name, table)


_LAYOUTS: dict[str, Callable[[Spec, Sequence[str]], _Layout]] = {"torch": _torch, "hf": _hf, "timm": _timm}


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
    """
    if source not in _LAYOUTS:
        raise ValueError(f"source must be one of {sorted(_LAYOUTS)}, got {source!r}")
    keys = list(state_dict)
    layout = _LAYOUTS[source](spec, keys)
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    missing: dict[str, None] = {}  # ordered set
    unmapped: list[str] = []
    mismatched: list[str] = []
    for target, shape in _expected(spec).items():
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
    untied = []
    for key, twin in layout.tied.items():
        if key in state_dict:
            used.add(key)
            if twin in state_dict and not torch.equal(state_dict[key], state_dict[twin]):
                untied.append(f"{key} differs from {twin}")
    unexpected = [k for k in keys if k not in used and not layout.ignored(k)]
    problems = [
        _listing("missing source keys", list(missing)) if missing else "",
        _listing("unexpected source keys", unexpected) if unexpected else "",
        _listing(f"spec parameters with no {layout.name} counterpart", unmapped) if unmapped else "",
        _listing("shape mismatches", mismatched) if mismatched else "",
        _listing("tied copies that differ (the spec ties the LM head)", untied) if untied else "",
    ]
    if any(problems):
        raise ValueError(
            f"cannot convert a {layout.name} state dict for spec {spec.name!r}:" + "".join(problems)
        )
    return out
