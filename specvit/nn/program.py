"""A decode step lowered from a model's graph into one native program, which ``generate`` runs once per token.

A decode step of a small model spends as much time beside its products as in them: each graph node is a
Python call, a module call and a few torch ops of a few microseconds each, and between two products that
work runs with the caches the streamed weights just evicted. :func:`lower_step` walks the model's graph in
order and writes each node as ops of ``gemv.c`` (:data:`LOWER`, one entry per op kind) over buffers it
allocates once: the token embedding and learned positions, RMSNorm and LayerNorm, the products (float32,
bfloat16 or int8 weights, :mod:`specvit.nn.gemv`), plain and gated MLPs (GELU, its tanh form, quick GELU,
ReLU, squared ReLU, SiLU), the residual adds, soft-capped logits, and each attention layer's step: QK-norm,
rotate-half RoPE or ALiBi, the new key and value into the layer's cache (a ring of the window's slots for a
sliding window or ``generate``'s ``cache_window``), one query over the cached keys, its scores soft-capped or
not. A step is then one call. A graph with a node the program has no op for (QK-norm after RoPE,
cross-attention, ...) is not lowered, and its steps run as before.

The values match the model's own step within float32 rounding: the attention and the norms sum in another
order, the activations take an exp of their own (``tests/test_program.py`` compares them).

Dim legend: M rows (one new token per sequence), D width, H query heads, Hkv key/value heads, hd head dim,
C capacity (the positions a generation holds), F the MLP's hidden width.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import networkx as nx
import torch
from torch import Tensor, nn

from specvit.nn import gemv
from specvit.nn.alibi import Alibi, alibi_slopes
from specvit.nn.attention import Attention
from specvit.nn.cache import KVCache
from specvit.nn.decoding import norm_settings
from specvit.nn.layers import TiedLinear, drops
from specvit.nn.linear import Linear
from specvit.nn.mlp import GluMlp, Mlp, QuickGELU, ReLUSquared
from specvit.nn.position import LearnedPosition, Rope
from specvit.nn.quant import Bf16Linear, Int8Linear

__all__ = ["LOWER", "NotLowered", "Slopes", "StepProgram", "compile_step", "lower_step"]


class NotLowered(Exception):
    """The model has a part the native step has no op for; the message names the graph node and why."""


class StepProgram:
    """One decode step of a model as a native program over buffers of its own: ``program(tokens, position)``
    returns the (M, V) logits of the tokens (M, 1) at ``position``, their keys and values kept for the next
    steps. Made by :func:`lower_step`; :meth:`load` takes the keys and values of the prompt.

    Args:
        rows: M, at most :data:`~specvit.nn.gemv.MAX_ROWS`.
        capacity: C, the most positions the program holds (prompt and generated tokens).
        remake: the same model's program of another capacity (:meth:`grown`).
        window: the most positions a causal layer sees (``generate``'s ``cache_window``), or None.
    """

    def __init__(
        self, rows: int, capacity: int, remake: Callable[[int], StepProgram], window: int | None = None
    ) -> None:
        self.rows, self.capacity, self.remake, self.window = rows, capacity, remake, window
        self.ids = torch.zeros(rows, dtype=torch.long)  # (M,) the step's tokens
        self.vocab = 0  # the token embedding's rows
        self.values: dict[str, Any] = {}  # each node's value: a buffer (M, width), tables, slopes, a name
        self.caches: dict[int, tuple[Tensor, Tensor]] = {}  # layer_idx: keys, values (M, Hkv, S, hd), S slots
        self.logits: Tensor | None = None  # (M, V)
        self._ops: list[gemv.Op] = []
        self._held: list[Tensor] = []  # every tensor whose address an op holds
        self._program: Any = None  # the ops as a ctypes array, once lowered

    def buffer(self, width: int) -> Tensor:
        """A new (M, width) float32 buffer."""
        out = torch.empty(self.rows, width)
        self._held.append(out)
        return out

    def emit(
        self, name: str, buffers: list[Tensor | None], sizes: list[int], floats: tuple[float, ...] = ()
    ) -> None:
        """Append the op ``name`` (:data:`~specvit.nn.gemv.OPS`) over ``buffers``."""
        self._held += [b for b in buffers if b is not None]
        self._ops.append(gemv.op(name, buffers, sizes, floats))

    def product(self, module: nn.Module, x: Tensor, node: str) -> Tensor:
        """The op of ``module``'s product with the rows x (M, K), and its (M, N) result."""
        kernel = _kernel(module, node)
        y = self.buffer(kernel.n)
        sizes = [self.rows, kernel.n, kernel.k, gemv.WEIGHT_TYPES[kernel.weight.dtype]]
        self.emit("gemv", [x, kernel.weight, kernel.scale, kernel.bias, y], sizes)
        return y

    def finish(self) -> StepProgram:
        """The ops as the array the native call runs."""
        self._program = (gemv.Op * len(self._ops))(*self._ops)
        return self

    def load(self, cache: KVCache) -> None:
        """Copy the keys and values ``cache`` holds (the prompt's) into the program's."""
        for layer, (keys, values) in self.caches.items():
            seen, held = cache.length(layer), cache.keys[layer]  # (M, Hkv, T, hd): the last T positions
            slots = torch.arange(seen - held.shape[2], seen) % keys.shape[2]
            keys[:, :, slots] = held
            values[:, :, slots] = cache.values[layer]

    def grown(self) -> StepProgram:
        """The program holding twice the positions, with the keys and values held so far (a layer's ring of
        S slots holds position p in slot p % S: S is C until it reaches the layer's window)."""
        bigger = self.remake(2 * self.capacity)
        for layer, (keys, values) in self.caches.items():
            more_keys, more_values = bigger.caches[layer]
            more_keys[:, :, : keys.shape[2]] = keys  # (M, Hkv, S, hd)
            more_values[:, :, : keys.shape[2]] = values
        return bigger

    def __call__(self, tokens: Tensor, position: int) -> Tensor:
        """The (M, V) logits of tokens (M, 1) at ``position`` (valid until the next call)."""
        if not 0 <= position < self.capacity or tokens.numel() != self.rows:
            raise ValueError(
                f"the step program holds {self.rows} rows and {self.capacity} positions, got tokens of shape "
                f"{list(tokens.shape)} at position {position}"
            )
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab:  # the native lookup reads row id
            raise ValueError(f"token ids must lie in 0..{self.vocab - 1}, got {tokens.flatten().tolist()}")
        self.ids.copy_(tokens.reshape(-1))
        gemv.run_program(self._program, position)
        assert self.logits is not None
        return self.logits


def _kernel(module: nn.Module, node: str) -> gemv.Gemv:
    """The native product of a linear layer: float32 or bfloat16 weights, or int8 with float32 scales."""
    plain = type(module) in (nn.Linear, Linear, TiedLinear) or isinstance(module, Bf16Linear)
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    try:
        if isinstance(module, Int8Linear) and module.scale.dtype == torch.float32:
            return gemv.Gemv(module.weight_int8, module.scale, module.bias)
        if plain and isinstance(weight, Tensor) and (bias is None or isinstance(bias, Tensor)):
            return gemv.Gemv(weight, bias=bias)  # float32 or bfloat16 (Gemv checks)
    except ValueError:  # a weight Gemv does not take: another dtype, not contiguous
        pass
    raise NotLowered(f"{node}: a {type(module).__name__} has no native product (float32, bfloat16 or int8)")


def _float32(t: Tensor | None, node: str) -> None:
    if t is not None and (t.dtype != torch.float32 or not t.is_cpu):
        raise NotLowered(f"{node}: {t.dtype} weights on {t.device} (the native step runs float32 on the CPU)")


Lower = Callable[[StepProgram, str, Any, Any, dict[str, Any]], None]
"""Writes one graph node's ops: ``lower(program, node, module or None, params, {port: value})``."""


def _input(program: StepProgram, node: str, module: None, p: Any, args: dict[str, Any]) -> None:
    program.values[node] = program.ids if p.arg == "tokens" else p.arg


def _token_embed(program: StepProgram, node: str, module: Any, p: Any, args: dict[str, Any]) -> None:
    if args["x"] is not program.ids or not isinstance(module, nn.Embedding) or module.max_norm is not None:
        raise NotLowered(f"{node}: only a token embedding (without max_norm) of the step's tokens")
    _float32(module.weight, node)
    width, program.vocab = module.embedding_dim, module.num_embeddings
    out = program.buffer(width)
    factor = math.sqrt(width) if getattr(module, "scale", False) else 1.0
    program.emit("embed", [module.weight.detach(), program.ids, out], [program.rows, width], (factor,))
    program.values[node] = out


def _rope(program: StepProgram, node: str, module: Any, p: Any, args: dict[str, Any]) -> None:
    if type(module) is not Rope or module.layout != "half":
        raise NotLowered(f"{node}: only rotate-half RoPE")
    cos, sin = module(torch.empty(1, program.capacity, 0), offset=0)  # (C, r) each
    program.values[node] = (cos.float().contiguous(), sin.float().contiguous())


def _norm(program: StepProgram, node: str, module: Any, p: Any, args: dict[str, Any]) -> None:
    out = program.buffer(args["x"].shape[1])
    _normed(program, node, module, args["x"], out)
    program.values[node] = out


def _normed(program: StepProgram, node: str, module: nn.Module, x: Tensor, out: Tensor) -> None:
    """The op of ``module``'s norm of the rows x (M, G D) into out (the same layout, or x itself), the G groups
    of D channels of a row normalised apart (a QK-norm's heads)."""
    settings = norm_settings(module)
    if settings is None or x.shape[1] % settings.dim:
        raise NotLowered(f"{node}: only a norm over the width, or over heads")
    weight, bias = (None if t is None else t.detach() for t in (settings.weight, settings.bias))
    _float32(weight, node)
    _float32(bias, node)
    sizes = [program.rows, settings.dim, settings.kind, x.stride(0), x.shape[1] // settings.dim]
    program.emit("norm", [x, weight, bias, out], sizes, (settings.eps, settings.offset))


def _learned_position(program: StepProgram, node: str, module: Any, p: Any, args: dict[str, Any]) -> None:
    if not isinstance(module, LearnedPosition):
        raise NotLowered(f"{node}: only a learned table of positions")
    table = module.weight.detach()[0]  # (rows, D)
    _float32(table, node)
    program.capacity = min(program.capacity, module.num_positions - module.start)  # no row past the table
    out = program.buffer(table.shape[1])
    program.emit(
        "position", [args["x"], table.contiguous(), out], [program.rows, table.shape[1], module.start]
    )
    program.values[node] = out


def _add(program: StepProgram, node: str, module: None, p: Any, args: dict[str, Any]) -> None:
    a, b = args["x"], args["branch"]
    out = program.buffer(a.shape[1])
    program.emit("add", [a, b, out], [a.numel()])
    program.values[node] = out


ACTIVATIONS: dict[type[nn.Module], int] = {nn.GELU: 0, QuickGELU: 2, nn.ReLU: 3, ReLUSquared: 4, nn.SiLU: 5}
"""An activation module's code in ``gemv.c`` (its ``ACT_`` enum); the tanh GELU is 1."""
SOFTCAP = 6
"""The code of Gemma 2's soft-capping ``cap * tanh(x / cap)`` among the activations."""


def _activation(act: nn.Module, node: str) -> int:
    code = ACTIVATIONS.get(type(act))
    if code is None:
        raise NotLowered(f"{node}: the native step has no {type(act).__name__} activation")
    return 1 if isinstance(act, nn.GELU) and act.approximate == "tanh" else code


def _mlp(program: StepProgram, node: str, module: Any, p: Any, args: dict[str, Any]) -> None:
    if not isinstance(module, Mlp | GluMlp) or module.norm is not None or getattr(module, "grid", None):
        raise NotLowered(f"{node}: only an MLP without an inner norm or conv")
    if drops(module.drop1) or drops(module.drop2):
        raise NotLowered(f"{node}: dropout in training")
    act = _activation(module.act, node)
    h = program.product(module.fc1, args["x"], node)  # (M, F), or (M, 2F) gated
    if isinstance(module, GluMlp):
        hidden = program.buffer(h.shape[1] // 2)  # (M, F)
        program.emit("glu", [h, hidden], [program.rows, hidden.shape[1], act])
    else:
        hidden = h
        program.emit("act", [h, h], [h.numel(), act])  # in place
    program.values[node] = program.product(module.fc2, hidden, node)


def _linear(program: StepProgram, node: str, module: Any, p: Any, args: dict[str, Any]) -> None:
    program.values[node] = program.product(module, args["x"], node)


def _output(program: StepProgram, node: str, module: None, p: Any, args: dict[str, Any]) -> None:
    if len(args) != 1:
        raise NotLowered(f"{node}: only one output, the logits")
    (program.logits,) = args.values()


def _refusal(core: Attention) -> str | None:
    """Why an attention core has no native step, or None."""
    parts = {
        "cross-attention": core.cross,
        "projections other than one packed qkv": core.projection != "packed",
        "values of another width or CaiT's queries": core.queries is not None or core.v_head_dim != core.head_dim,
        "QK-norm after RoPE": core.qk_norm_after_rope and not isinstance(core.q_norm, nn.Identity),
        "a bias on some of q, k, v only": any(hasattr(core, f"{n}_bias") for n in "qkv"),
        "a non-causal layer": not core.causal,
        "scores other than q.k times a scale (and a cap)": core.cosine or core.talking_heads or core.gated
        or core.disentangled or core.relative is not None,
        "windows over a grid, global tokens or an output gate": core.grid_window is not None
        or core.global_tokens is not None or core.output_gate,
        "dropout in training": (core.training and core.attn_drop > 0) or drops(core.proj_drop),
        "heads wider than 512": core.head_dim > 512,
    }  # fmt: skip
    return next((what for what, found in parts.items() if found), None)


def _attention(program: StepProgram, node: str, core: Any, p: Any, args: dict[str, Any]) -> None:
    why = _refusal(core) if isinstance(core, Attention) else "not specvit's attention core"
    extra = (
        set(args)
        - {"x", "mask", "rope", "cache"}
        - ({"bias"} if isinstance(args.get("bias"), Slopes) else set())
    )
    if why is None and (extra or "cache" not in args):
        why = f"inputs {sorted(extra)} (a bias, positions)" if extra else "no KV cache"
    if why is None and core.layer_idx in program.caches:
        why = f"a second layer with layer_idx {core.layer_idx} (shared weights)"
    if why is not None:
        raise NotLowered(f"{node}: {why}")
    m, h, hkv, hd, c = program.rows, core.num_heads, core.num_kv_heads, core.head_dim, program.capacity
    cos, sin = args.get("rope", (None, None))
    r = 0 if cos is None else cos.shape[1]
    window = min((w for w in (core.window, program.window) if w is not None), default=None)
    slots = c if window is None else min(c, window)  # S: position p in slot p % S, written at step p
    qkv = program.product(core.qkv, args["x"], node)  # (M, (H + 2 Hkv) hd)
    if not isinstance(core.q_norm, nn.Identity):  # QK-norm of q's and k's heads, in place, before RoPE
        q, k = qkv[:, : h * hd], qkv[:, h * hd : (h + hkv) * hd]  # (M, H hd), (M, Hkv hd) views
        _normed(program, node, core.q_norm, q, q)
        _normed(program, node, core.k_norm, k, k)
    keys, values = torch.empty(m, hkv, slots, hd), torch.empty(m, hkv, slots, hd)
    heads, scratch = program.buffer(h * hd), torch.empty(m, h, slots + hd)  # (M, H hd), (M, H, S + hd)
    scale = 1.0 / math.sqrt(hd) if core.scale is None else core.scale
    slopes = args["bias"].slopes if "bias" in args else None
    buffers = [qkv, cos, sin, keys, values, heads, scratch, slopes]
    cap = core.softcap or 0.0  # Gemma 2's soft-capped scores
    program.emit("attend", buffers, [m, h, hkv, hd, r, c, window or 0, slots], (scale, cap))
    program.caches[core.layer_idx] = (keys, values)
    program.values[node] = (
        heads if isinstance(core.proj, nn.Identity) else program.product(core.proj, heads, node)
    )


class Slopes(NamedTuple):
    """The value of an ALiBi node: its heads' slopes (H,), the bias of key position p ``slope * p``."""

    slopes: Tensor


def _alibi(program: StepProgram, node: str, module: Any, p: Any, args: dict[str, Any]) -> None:
    if not isinstance(module, Alibi) or not module.causal:
        raise NotLowered(f"{node}: only causal ALiBi")
    program.values[node] = Slopes(alibi_slopes(module.heads).float().contiguous())


def _softcap(program: StepProgram, node: str, module: None, p: Any, args: dict[str, Any]) -> None:
    out = program.buffer(args["x"].shape[1])
    program.emit("act", [args["x"], out], [args["x"].numel(), SOFTCAP], (p.cap,))
    program.values[node] = out


def _inactive(program: StepProgram, node: str, module: Any, p: Any, args: dict[str, Any]) -> None:
    """Dropout in eval mode (or of probability 0): the input itself."""
    if module is not None and drops(module):
        raise NotLowered(f"{node}: dropout in training")
    program.values[node] = args["x"]


LOWER: dict[str, Lower] = {
    "input": _input,
    "token_embed": _token_embed,
    "rope": _rope,
    "alibi": _alibi,
    "rmsnorm": _norm,
    "layernorm": _norm,
    "pos_learned": _learned_position,
    "self_attention": _attention,
    "add": _add,
    "mlp": _mlp,
    "linear": _linear,
    "dropout": _inactive,
    "softcap": _softcap,
    "output": _output,
}
"""How each op kind of the graph is written as native ops; a kind not here is not lowered."""


def lower_step(model: nn.Module, rows: int, capacity: int, window: int | None = None) -> StepProgram:
    """The decode step of ``model`` (a decoder-only :class:`~specvit.model.SpecModel`) as a native program.

    Args:
        model: the model; the program reads its weights' memory (updates in place are seen).
        rows: M, the sequences decoded together (at most :data:`~specvit.nn.gemv.MAX_ROWS`).
        capacity: C, the most positions held (the prompt's and the new tokens').
        window: every causal layer sees at most this many positions (``generate``'s ``cache_window``), or None.

    Raises:
        NotLowered: a part the program has no op for, or the kernels are not available here.
    """
    if not gemv.available():
        raise NotLowered("the native kernels are not available here")
    if not 1 <= rows <= gemv.MAX_ROWS:
        raise NotLowered(f"{rows} rows: the native step takes 1 to {gemv.MAX_ROWS}")
    graph = getattr(model, "graph", None)
    if graph is None:
        raise NotLowered(f"a {type(model).__name__} has no graph")
    if any(not t.is_cpu for t in model.parameters()):
        raise NotLowered("the model is not on the CPU")
    program = StepProgram(rows, capacity, functools.partial(lower_step, model, rows, window=window), window)
    for node in nx.topological_sort(graph.nx):
        attrs = graph[node]
        lower = LOWER.get(attrs["op"])
        if lower is None:
            raise NotLowered(f"{node}: the native step has no {attrs['op']!r} op")
        args = {d["port"]: program.values[u] for u, _, d in graph.nx.in_edges(node, data=True)}
        module = model.get_submodule(node) if attrs["module"] else None
        lower(program, node, module, attrs["p"], args)
    if program.logits is None or not program.vocab:
        raise NotLowered("the graph has no token embedding of the step's tokens, or no output")
    return program.finish()


def compile_step(model: nn.Module, rows: int, capacity: int, window: int | None = None) -> StepProgram | None:
    """:func:`lower_step`, or None where the model is not lowered (its steps then run as before)."""
    try:
        return lower_step(model, rows, capacity, window)
    except NotLowered:
        return None
