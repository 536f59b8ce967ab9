"""The compiler: ArchGraph -> torch ``nn.Module``, one builder per op kind, and the family inits.

The compiler reads the graph, not the spec: each module node's ``op`` and ``hparams`` choose and
configure its module. Every model is built on the meta device and then materialised and initialised
by :func:`init_weights`, so that a normal build and a meta-device build followed by ``to_empty()`` and
``init_weights()`` give the same weights under the same seed, and no default init is paid for twice.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any

import torch
from torch import nn

from specvit.graph.ir import ArchGraph
from specvit.model import MODEL_CLASSES, SharedEmbedding, SharedLinear, SpecModel, TiedLinear
from specvit.nn import (
    BoxMlp,
    CrossAttention,
    LayerScale,
    LearnedPosition,
    PatchEmbed,
    PrefixTokens,
    QueryEmbed,
    SelfAttention,
    SinCos2dPosition,
    SinCosPosition,
    Sine2dPosition,
    TokenEmbed,
    build_mlp,
)
from specvit.nn.window import PatchMerging, WindowAttention
from specvit.spec.schema import Spec

__all__ = ["BUILDERS", "available_memory", "build_model", "init_weights"]

Attrs = dict[str, Any]
BuilderFn = Callable[[Attrs, dict[str, nn.Module], Any], nn.Module]


def _attention(a: Attrs, built: dict[str, nn.Module], f: Any) -> nn.Module:
    hp = a["hparams"]
    common = dict(
        num_kv_heads=hp["kv_heads"],
        head_dim=hp["head_dim"],
        qkv_bias=hp["qkv_bias"],
        proj_bias=hp["proj_bias"],
        qk_norm=hp["qk_norm"],
        norm_eps=hp["eps"],
        attn_drop=hp["attn_drop"],
        proj_drop=hp["proj_drop"],
        **f,
    )
    if a["op"] == "window_attention":
        return WindowAttention(
            hp["dim"],
            hp["heads"],
            tuple(hp["grid"]),
            hp["window"],
            hp["shift"],
            qkv_bias=hp["qkv_bias"],
            proj_bias=hp["proj_bias"],
            attn_drop=hp["attn_drop"],
            proj_drop=hp["proj_drop"],
            **f,
        )
    if a["op"] == "cross_attention":
        return CrossAttention(hp["dim"], hp["heads"], memory_dim=hp["memory_dim"], **common)
    return SelfAttention(hp["dim"], hp["heads"], causal=hp["causal"], **common)


def _token_embed(a: Attrs, built: dict[str, nn.Module], f: Any) -> nn.Module:
    hp = a["hparams"]
    if hp["shared_with"]:
        return SharedEmbedding(built[hp["shared_with"]])  # type: ignore[arg-type]
    return TokenEmbed(hp["vocab"], hp["dim"], padding_idx=hp["padding_idx"], scale=hp["scale"], **f)


def _linear(a: Attrs, built: dict[str, nn.Module], f: Any) -> nn.Module:
    hp = a["hparams"]
    if hp.get("tied_to"):
        return TiedLinear(built[hp["tied_to"]], bias=hp["bias"], **f)  # type: ignore[arg-type]
    if hp.get("shared_with"):
        return SharedLinear(built[hp["shared_with"]])  # type: ignore[arg-type]
    return nn.Linear(hp["in"], hp["out"], bias=hp["bias"], **f)


def _patch_embed(a: Attrs, built: dict[str, nn.Module], f: Any) -> nn.Module:
    hp = a["hparams"]
    (gh, gw), (ph, pw) = hp["grid"], hp["patch"]
    return PatchEmbed(
        (gh * ph, gw * pw),
        (ph, pw),
        hp["channels"],
        hp["dim"],
        projection=hp["projection"],
        bias=hp["bias"],
        **f,
    )


def _patch_merging(a: Attrs, built: dict[str, nn.Module], f: Any) -> nn.Module:
    hp = a["hparams"]
    norm = BUILDERS[hp["norm"]](
        {"hparams": {"dim": 4 * hp["dim"], "eps": hp["eps"], "bias": hp["bias"]}}, built, f
    )
    return PatchMerging(hp["dim"], tuple(hp["grid"]), norm, **f)


BUILDERS: dict[str, BuilderFn] = {
    "patch_embed": _patch_embed,
    "token_embed": _token_embed,
    "type_embed": lambda a, b, f: nn.Embedding(a["hparams"]["type_vocab"], a["hparams"]["dim"], **f),
    "linear": _linear,
    "prefix": lambda a, b, f: PrefixTokens(
        a["hparams"]["dim"], a["hparams"]["cls"], a["hparams"]["registers"], **f
    ),
    "pos_learned": lambda a, b, f: LearnedPosition(a["hparams"]["max_len"], a["hparams"]["dim"], **f),
    "pos_sincos": lambda a, b, f: SinCosPosition(a["hparams"]["dim"], a["hparams"]["base"]),
    "pos_sincos2d": lambda a, b, f: SinCos2dPosition(
        a["hparams"]["dim"], tuple(a["hparams"]["grid"]), a["hparams"]["base"]
    ),
    "layernorm": lambda a, b, f: nn.LayerNorm(
        a["hparams"]["dim"], eps=a["hparams"]["eps"], bias=a["hparams"]["bias"], **f
    ),
    "rmsnorm": lambda a, b, f: nn.RMSNorm(a["hparams"]["dim"], eps=a["hparams"]["eps"], **f),
    "self_attention": _attention,
    "masked_self_attention": _attention,
    "cross_attention": _attention,
    "window_attention": _attention,
    "patch_merging": _patch_merging,
    "mlp": lambda a, b, f: build_mlp(
        a["hparams"]["dim"],
        a["hparams"]["hidden"],
        a["hparams"]["activation"],
        bias=a["hparams"]["bias"],
        dropout=a["hparams"]["dropout"],
        **f,
    ),
    "layer_scale": lambda a, b, f: LayerScale(a["hparams"]["dim"], a["hparams"]["init"], **f),
    "queries": lambda a, b, f: QueryEmbed(a["hparams"]["count"], a["hparams"]["dim"], **f),
    "pos_sine2d": lambda a, b, f: Sine2dPosition(
        a["hparams"]["dim"], tuple(a["hparams"]["grid"]), a["hparams"]["base"]
    ),
    "box_mlp": lambda a, b, f: BoxMlp(a["hparams"]["dim"], a["hparams"]["layers"], **f),
}


_INIT_FUNCTIONS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
)


@contextlib.contextmanager
def _skip_default_init() -> Iterator[None]:
    """Make torch.nn.init's functions no-ops while modules are constructed (as HF's ``no_init_weights``).

    The parameters live on the meta device and :func:`init_weights` draws every one of them afterwards (it
    raises on any parameter without a rule), so the default inits would be work thrown away: on ViT-H they
    are half of the build time. Not thread-safe: do not construct other modules in another thread meanwhile.
    """
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}

    def skip(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return tensor

    try:
        for name in _INIT_FUNCTIONS:
            setattr(nn.init, name, skip)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _compile(graph: ArchGraph, dtype: torch.dtype | None) -> SpecModel:
    built: dict[str, nn.Module] = {}
    # Every parameter is created on the meta device explicitly (cheaper than a torch.device("meta") context,
    # which intercepts every torch call); build_model materialises and initialises them afterwards.
    factory = {"dtype": dtype, "device": "meta"}

    def build(path: str) -> nn.Module:
        module = BUILDERS[graph[path]["op"]](graph[path], built, factory)
        built[path] = module
        return module

    with _skip_default_init():
        return MODEL_CLASSES[graph.spec.model](graph, build)


def _fill_full(param: torch.Tensor, fn: Callable[[torch.Tensor], Any]) -> None:
    """Initialise ``param`` in place with ``fn``; a sharded DTensor gets its shard of the full tensor.

    ``fn`` always sees a float32 tensor of the parameter's full shape, so the random stream it draws from
    (and hence every value, up to the final cast) is the same on one process as under FSDP, on every rank,
    and in any dtype.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        local = param.to_local()
        full = torch.empty(param.shape, dtype=param.dtype, device=local.device)
        fn(full)
        local.copy_(
            distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        )
    else:
        fn(param)


def init_weights(model: nn.Module, kind: str) -> None:
    """Initialise every parameter of ``model`` by a family convention, in module order.

    Works on plain and on FSDP2-sharded models: each parameter is drawn at its full shape, so the
    weights equal a single-process build's under the same ``torch.manual_seed``.

    Args:
        model: a compiled model (or any module tree of specvit parts).
        kind: ``vit`` (timm/HF ViT: trunc-normal 0.02 weights, zero biases, 1e-6 class token, zero
            classifier), ``xavier`` (torch.nn.Transformer: xavier-uniform matrices, zero biases) or
            ``normal`` (BERT/GPT-2: N(0, 0.02) weights and embeddings, zero biases).
    """

    def matrix(w: torch.Tensor) -> None:
        if kind == "xavier":
            nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        elif kind == "vit":
            nn.init.trunc_normal_(w, std=0.02)
        else:
            nn.init.normal_(w, std=0.02)

    def embedding(padding_idx: int | None) -> Callable[[torch.Tensor], None]:
        def fn(w: torch.Tensor) -> None:
            matrix(w)
            if padding_idx is not None:
                w[padding_idx].zero_()

        return fn

    head = getattr(model, "head", None)
    zero_head = kind == "vit" and head is not None and isinstance(getattr(head, "fc", None), nn.Linear)
    done: set[int] = set()

    def _fill(param: torch.Tensor, fn: Callable[[torch.Tensor], Any]) -> None:
        _fill_full(param, fn)
        done.add(id(param))

    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear | nn.Conv2d):
                _fill(m.weight, nn.init.zeros_ if zero_head and m is head.fc else matrix)  # type: ignore[union-attr]
                if m.bias is not None:
                    _fill(m.bias, nn.init.zeros_)
            elif isinstance(m, nn.Embedding):
                _fill(m.weight, embedding(m.padding_idx))
            elif isinstance(m, nn.LayerNorm | nn.RMSNorm):
                if m.weight is not None:
                    _fill(m.weight, nn.init.ones_)
                if getattr(m, "bias", None) is not None:
                    _fill(m.bias, nn.init.zeros_)  # type: ignore[arg-type]
            elif isinstance(m, LayerScale):
                _fill(m.gamma, partial(nn.init.constant_, val=m.init_value))
            elif isinstance(m, LearnedPosition):
                _fill(
                    m.weight,
                    lambda t: (nn.init.trunc_normal_ if kind == "vit" else nn.init.normal_)(t, std=0.02),
                )
            elif isinstance(m, PrefixTokens):
                for p in m.parameters(recurse=False):
                    _fill(p, lambda t: nn.init.normal_(t, std=1e-6 if kind == "vit" else 0.02))
            elif isinstance(m, TiedLinear) and m.bias is not None:
                _fill(m.bias, nn.init.zeros_)
            elif isinstance(m, QueryEmbed):  # DETR: nn.Embedding's N(0, 1)
                _fill(m.weight, nn.init.normal_)
            elif isinstance(m, WindowAttention):  # its Linear children are filled above
                _fill(m.relative_position_bias_table, partial(nn.init.trunc_normal_, std=0.02))
    missed = [name for name, p in model.named_parameters() if id(p) not in done]
    if missed:
        raise RuntimeError(f"init_weights has no rule for {', '.join(missed)}")


def _resolve(
    source: Spec | ArchGraph | str | os.PathLike[str], overrides: Mapping[str, Any] | None
) -> ArchGraph:
    from specvit.graph import build_graph
    from specvit.spec import load_spec, parse_spec

    if isinstance(source, ArchGraph):
        if overrides:
            raise ValueError("overrides apply to specs; lower the overridden spec into a new graph instead")
        return source
    if isinstance(source, Spec):
        spec = (
            parse_spec(source.model_dump(), source=source.name, overrides=overrides) if overrides else source
        )
    else:
        spec = load_spec(source, overrides=overrides)
    return build_graph(spec)


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation on this machine (Linux ``MemAvailable``), if known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _check_fits(
    graph: ArchGraph, device: torch.device, dtype: torch.dtype | None, max_bytes: int | None
) -> None:
    from specvit.diagram.text import format_count
    from specvit.errors import SpecError

    if device.type == "meta":
        return
    item = torch.empty((), dtype=dtype or torch.get_default_dtype(), device="meta").element_size()
    need = graph.total_params * item
    limit, what = (max_bytes, "the limit given") if max_bytes is not None else (None, "")
    if limit is None and device.type == "cpu":
        limit, what = available_memory(), "the memory available"
    if limit is not None and need > limit:
        raise SpecError.at(
            f"{graph.name}: its {graph.total_params:,} parameters need {format_count(need)}B as "
            f"{str(dtype or torch.get_default_dtype()).removeprefix('torch.')}, more than {what} "
            f"({format_count(limit)}B)",
            hint='build it on device="meta" to inspect it without allocating, or on a machine with more memory',
        )


def build_model(
    source: Spec | ArchGraph | str | os.PathLike[str],
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    max_bytes: int | None = None,
    checkpointing: bool = False,
) -> SpecModel:
    """Compile a spec (or its graph, or a spec file) into a PyTorch model.

    Args:
        source: a Spec, an ArchGraph, or the path of a spec file.
        device: where the weights live; ``"meta"`` builds without allocating (then ``to_empty()`` and
            ``init_weights()``). Default: CPU.
        dtype: parameter dtype (default: torch's default dtype).
        overrides: dotted-key overrides for a spec or spec file, e.g. ``{"encoder.depth": 2}``.
        max_bytes: refuse to allocate weights larger than this; on CPU the default limit is the memory
            available. Building on the meta device is never refused.
        checkpointing: recompute each block's activations in the backward pass instead of storing
            them (``torch.utils.checkpoint``): less memory for one more forward per block in training.

    Raises:
        SpecError: for an invalid spec, or weights that would not fit (before anything is allocated).

    Returns:
        An :class:`EncoderModel`, :class:`DecoderModel` or :class:`EncoderDecoderModel`, in train mode like
        any fresh ``nn.Module``.
    """
    graph = _resolve(source, overrides)
    target = torch.device(device or "cpu")
    _check_fits(graph, target, dtype, max_bytes)
    model = _compile(graph, dtype)
    model.set_checkpointing(checkpointing)
    if target.type != "meta":
        model.to_empty(device=target)
        model.init_weights()
    return model
