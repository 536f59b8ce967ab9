"""Residual block patterns, as expansions into the block-graph form a spec may also write by hand.

A block is a list of :class:`Step` s (named nodes of registered ops reading earlier nodes by name, ``x``
being the block's input); :func:`expand` writes a block spec's pattern in that form and
:func:`lower_steps` lowers any such list, so a pattern and a hand-written ``graph:`` are one thing.

- ``pre``: ``x + f(norm(x))`` per sublayer (ViT, GPT-2).
- ``post``: ``norm(x + f(x))`` per sublayer (the original Transformer, BERT).
- ``sandwich``: ``x + post_norm(f(norm(x)))`` (Gemma 2, CogView).
- ``res_post``: ``x + norm(f(x))`` (Swin-V2).
- ``parallel``: ``x + f1(norm1(x)) + f2(norm2(x))``, every sublayer reading the block's input (GPT-J,
  GPT-NeoX, PaLM).

Each branch is ``sublayer -> [layer scale] -> [drop path]`` before its add. From a ``class_attention``
sublayer on (CaiT), the adds update the class token alone (``class_token``) and the block ends by putting
it back in front of the other tokens (``join_class_token``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specvit.ops.block import SUBLAYERS, BlockCtx
from specvit.ops.structure import AddParams, ClassTokenParams, DropParams, LayerScaleParams

__all__ = ["Step", "expand", "lower_steps", "sublayer_names"]


@dataclass(frozen=True)
class Step:
    """One node of a block.

    Args:
        name: its name in the block, also its module's (``attn``, ``norm1``).
        op: a sublayer kind, ``norm``, ``add``, ``layer_scale`` or ``drop_path``.
        inputs: the names of the nodes it reads (``x``: the block's input).
        source: the spec key it comes from, for located errors.
    """

    name: str
    op: str
    inputs: tuple[str, ...]
    source: str


def sublayer_names(layers: list[str]) -> list[str]:
    """Module names of a block's sublayers: ``attn``, ``mlp``, numbered when one occurs twice (``attn1``)."""
    names = [SUBLAYERS[layer].name for layer in layers]
    return [f"{nm}{k + 1}" if names.count(nm) > 1 else nm for k, nm in enumerate(names)]


def expand(spec: Any, role: str) -> list[Step]:
    """The steps of a block spec: its ``graph`` as written, or its residual pattern written out.

    Args:
        spec: the block's spec.
        role: ``encoder`` or ``decoder``, for the spec keys of the steps.
    """
    at = f"{role}.block"
    if spec.graph is not None:
        return [Step(n.name, n.op, tuple(n.inputs), f"{at}.graph.{i}") for i, n in enumerate(spec.graph)]
    placement, steps = spec.norm.placement, []
    x, branches, whole = "x", [], ""
    for k, (layer, name) in enumerate(zip(spec.layers, sublayer_names(spec.layers), strict=True), start=1):
        source, norm = f"{at}.layers.{k - 1}", f"{at}.norm"
        h = x
        if placement in ("pre", "sandwich"):
            steps.append(Step(f"norm{k}", "norm", (x,), norm))
            h = f"norm{k}"
        steps.append(Step(name, layer, (h,), source))
        h = name
        if placement in ("sandwich", "res_post"):
            post = f"post_norm{k}" if placement == "sandwich" else f"norm{k}"
            steps.append(Step(post, "norm", (h,), norm))
            h = post
        if spec.layer_scale is not None:
            steps.append(Step(f"ls{k}", "layer_scale", (h,), f"{at}.layer_scale"))
            h = f"ls{k}"
        steps.append(Step(f"drop_path{k}", "drop_path", (h,), f"{role}.drop_path"))
        h = f"drop_path{k}"
        if spec.parallel:
            branches.append(h)
            continue
        if getattr(SUBLAYERS[layer], "class_token_only", False) and not whole:
            whole = x  # CaiT's class attention: from here on the adds update the class token alone
            steps.append(Step("cls", "class_token", (x,), source))
            x = "cls"
        steps.append(Step(f"add{k}", "add", (x, h), source))
        x = f"add{k}"
        if placement == "post":
            steps.append(Step(f"norm{k}", "norm", (x,), norm))
            x = f"norm{k}"
    for k, h in enumerate(branches, start=1):  # parallel: the branches are summed onto x in order
        steps.append(Step(f"add{k}", "add", (x, h), f"{at}.parallel"))
        x = f"add{k}"
    if whole:  # the updated class token back in front of the other tokens
        steps.append(Step("join", "join_class_token", (whole, x), f"{at}.layers"))
    return steps


def lower_steps(b: BlockCtx, steps: list[Step], x: str, drop_path: float | None) -> str:
    """Add the nodes of ``steps`` to block ``b``, reading ``x``; return the last step's node.

    Args:
        b: the block being lowered.
        steps: its steps, from :func:`expand`.
        x: the node of the block's input tokens.
        drop_path: the block's stochastic-depth rate, or None when the stack has none (drop_path steps
            then pass their input through).
    """
    values = {"x": x}
    out = x
    for st in steps:
        ins = [values[name] for name in st.inputs]
        if st.op in SUBLAYERS:
            out = SUBLAYERS[st.op].lower(b, ins[0], st.name, st.source)
        elif st.op == "norm":
            out = b.norm(st.name, ins[0], st.source)
        elif st.op == "layer_scale":
            p = LayerScaleParams(b.dim, b.spec.layer_scale if b.spec.layer_scale is not None else 1.0)
            out = b.add(st.name, "layer_scale", p, {"x": ins[0]}, source=st.source)
        elif st.op in ("class_token", "join_class_token"):  # a block updating the class token alone
            srcs = dict(zip(("x", "cls"), ins, strict=False))
            out = b.add(st.name, st.op, ClassTokenParams(), srcs, source=st.source)
        elif st.op == "drop_path":
            out = ins[0]
            if drop_path is not None:
                out = b.add(st.name, "drop_path", DropParams(drop_path), {"x": out}, source=st.source)
        else:  # add: x + a + b ... as a chain of two-input adds, the last one named as the step
            out = ins[0]
            for k, branch in enumerate(ins[1:], start=1):
                name = st.name if k == len(ins) - 1 else f"{st.name}_{k}"
                out = b.add(name, "add", AddParams(), {"x": out, "branch": branch}, source=st.source)
        values[st.name] = out
    return out
