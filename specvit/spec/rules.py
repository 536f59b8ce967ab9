"""Cross-field rules: what makes a well-typed spec unbuildable, each with the fix.

Runs after the per-field validation of :mod:`specvit.spec.schema` and returns every problem,
each with the key path to edit; the loader adds the file:line:col.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from specvit.errors import Problem
from specvit.ops.facts import unless_undetermined
from specvit.ops.inputs import ImageInput, SiameseInput, TokensInput, divisors_near
from specvit.spec.rules_block import check_layers, check_positions
from specvit.spec.rules_cait import check_cait
from specvit.spec.rules_stages import check_stages
from specvit.spec.rules_window import check_window
from specvit.spec.schema import Spec, StackSpec

__all__ = ["check"]


def _stack(role: str, s: StackSpec, spec: Spec) -> list[Problem]:
    out: list[Problem] = []
    b = s.block
    at = f"{role}.block"
    if s.hierarchical or isinstance(b.heads, list) or b.window is not None:
        out += _hierarchy(role, s)
    else:
        if b.head_dim is None and s.width % s.heads:
            out.append(
                Problem(
                    f"{at}.heads",
                    f"width {s.width} is not divisible by {s.heads} heads",
                    f"use a divisor of {s.width} such as {divisors_near(s.width, s.heads)}, "
                    "or set block.head_dim",
                )
            )
        if b.kv_heads is not None and s.heads % b.kv_heads:
            out.append(
                Problem(
                    f"{at}.kv_heads",
                    f"{s.heads} heads are not divisible by kv_heads={b.kv_heads}",
                    f"use a divisor of {s.heads} such as {divisors_near(s.heads, b.kv_heads)}",
                )
            )
    if s.total_depth == 0 and not (role == "encoder" and spec.model == "encoder_decoder"):
        out.append(
            Problem(
                f"{role}.depth",
                "a stack of depth 0 has no blocks; only an encoder_decoder's encoder may "
                "(it embeds the input the decoder cross-attends to, as Perceiver's)",
                "use a depth of 1 or more",
            )
        )
    rules: list[Callable[[], list[Problem]]] = [
        partial(check_layers, role, s, spec),
        partial(check_window, role, s),
        partial(check_stages, role, s),
        partial(_siamese, role, s, spec) if isinstance(s.input, SiameseInput) else list,
        partial(s.input.check, f"{role}.input", s, spec),
        partial(s.masking.check, f"{role}.masking", s, spec) if s.masking is not None else list,
        partial(check_positions, role, s, spec),
        partial(check_cait, role, s, spec),
        partial(_embed_width, role, s, spec),
        partial(_share, role, s),
    ]
    for rule in rules:  # a rule reading the head dim of heads that do not divide the width says nothing more
        out += unless_undetermined(rule)
    return out


def _embed_width(role: str, s: StackSpec, spec: Spec) -> list[Problem]:
    """What embeddings narrower (or wider) than the blocks cannot combine with."""
    if s.embed_width is None:
        return []
    why = ""
    if s.input.kind != "tokens":
        why = f"embed_width sizes token embeddings, and the {role} reads {s.input.kind}"
    elif s.num_prefix:
        why = "prefix tokens join the embeddings at the blocks' width"
    elif spec.shared_embeddings:
        why = "shared embeddings are the encoder's table, of its width"
    elif (
        spec.output_stack == role
        and getattr(spec.head, "tied", False)
        and not getattr(spec.head, "ops", None)
    ):
        why = f"a tied head uses the {s.embed_width}-wide token table on {s.out_width}-wide tokens"
    if not why:
        return []
    return [Problem(f"{role}.embed_width", why, "remove embed_width (or the feature it meets)")]


def _share(role: str, s: StackSpec) -> list[Problem]:
    """What blocks sharing weights need: one depth that the sets divide, one block per set, and no setting
    that differs between the layers a set runs (a stochastic-depth rate, the tokens, MoE statistics)."""
    if s.share is None:
        return []
    at, n = f"{role}.share", s.share.blocks
    why, fix = "", "remove share"
    if s.hierarchical:
        why = "shared blocks are a plain stack's: one number for depth"
    elif s.total_depth % n:
        why = f"{n} sets of block weights do not divide the depth {s.total_depth}"
        fix = f"set share.blocks to a divisor of {s.total_depth}"
    elif s.drop_path:
        at, why = (
            f"{role}.drop_path",
            "stochastic depth's rate grows with the layer, and shared blocks have one",
        )
        fix = "set drop_path: 0, or remove share"
    elif s.prefix_at:
        at, why = f"{role}.prefix.at", "prefix tokens entering between blocks change what a shared block sees"
        fix = "remove prefix.at, or remove share"
    elif any(b.mlp.moe is not None for b in s.layer_blocks):
        why = "an MoE block passes its router statistics on, and a shared block would count them once"
        fix = "remove share, or the MoE MLP"
    if why:
        return [Problem(at, why, fix)]
    first: dict[int, int] = {}
    for i in range(s.total_depth):
        j = first.setdefault(s.weight_set(i), i)
        if s.layer(j) is not s.layer(i):
            return [
                Problem(
                    at,
                    f"layers {j} and {i} share one set of weights, and their blocks differ",
                    "give the layers of a set the same block, or remove share",
                )
            ]
    return []


def _siamese(role: str, s: StackSpec, spec: Spec) -> list[Problem]:
    """Rules of a siamese input: a decoder reading the shared encoder's output for a second image (CroCo)."""
    enc = spec.encoder
    at = f"{role}.input.kind"
    if not (role == "decoder" and spec.model == "encoder_decoder" and enc is not None):
        return [
            Problem(
                at,
                "a siamese input is the encoder's output for a second image, so it needs an encoder",
                "use siamese only as the decoder input of an encoder_decoder model",
            )
        ]
    if not isinstance(enc.input, ImageInput) or enc.hierarchical:
        return [
            Problem(
                at,
                f"a siamese decoder runs the encoder on a second image, and the encoder reads "
                f"{enc.input.kind if not enc.hierarchical else 'images in stages'}",
                "give the encoder a plain image input (one number for depth), as CroCo's ViT",
            )
        ]
    out: list[Problem] = []
    for key in ("encoder.prefix", f"{role}.prefix"):
        if (enc if key.startswith("encoder") else s).num_prefix:
            out.append(
                Problem(
                    key,
                    "a siamese decoder's tokens are the encoder's patch tokens, without prefix tokens",
                    "remove the class and register tokens (CroCo has none)",
                )
            )
    for p in s.positions:
        if p.kind in ("none", "rope2d"):
            continue
        out.append(
            Problem(
                f"{role}.position",
                f"a siamese decoder reads positioned encoder tokens; {p.kind} positions do not apply",
                "use rope2d (on the encoder's patch grid, as CroCo) or none",
            )
        )
    return out


def _hierarchy(role: str, s: StackSpec) -> list[Problem]:
    """Rules of hierarchical stacks (depth per stage) and windowed attention (Swin)."""
    out: list[Problem] = []
    b, at = s.block, f"{role}.block"
    what = "windowed attention" if not s.hierarchical else "a hierarchical stack (depth per stage)"
    if not isinstance(s.input, ImageInput):
        return [
            Problem(
                f"{role}.depth" if s.hierarchical else f"{at}.window",
                f"{what} needs an image input",
                "use an image input, or one number for depth and no window",
            )
        ]
    if isinstance(b.heads, list) and not s.hierarchical:
        return [
            Problem(
                f"{at}.heads",
                "heads is a list but depth is one number",
                "give depth per stage too, e.g. depth: [2, 2, 6, 2]",
            )
        ]
    if len(s.stage_heads) != len(s.stage_depths):
        return [
            Problem(
                f"{at}.heads",
                f"{len(s.stage_heads)} stages of heads, but depth has {len(s.stage_depths)}",
                "give one head count per stage",
            )
        ]
    for i, (width, heads) in enumerate(zip(s.stage_widths, s.stage_heads, strict=False)):  # widths: own rule
        if width % heads:
            out.append(
                Problem(
                    f"{at}.heads",
                    f"stage {i} is {width} wide, not divisible by {heads} heads",
                    f"use a divisor of {width} such as {divisors_near(width, heads)}",
                )
            )
    return out + _grid(role, s) + _hierarchy_features(role, s, what)


def _grid(role: str, s: StackSpec) -> list[Problem]:
    """The patch grid must halve once per stage, and split into windows in every stage."""
    assert isinstance(s.input, ImageInput)
    out: list[Problem] = []
    b, at = s.block, f"{role}.block"
    gh, gw = s.input.grid
    merges = len(s.stage_depths) - 1
    if s.downsample is None and (gh % 2**merges or gw % 2**merges):  # a downsample checks its own sizes
        out.append(
            Problem(
                f"{role}.depth",
                f"{merges + 1} stages halve the {gh}x{gw} patch grid {merges} times, "
                f"which needs it divisible by {2**merges}",
                "use fewer stages, or an image and patch size giving a divisible grid",
            )
        )
    elif b.window is not None:
        m = b.window.size
        for i, (sh, sw) in enumerate(s.stage_grids):
            if min(sh, sw) > m and (sh % m or sw % m) and not b.window.pad:
                out.append(
                    Problem(
                        f"{at}.window.size",
                        f"stage {i}'s {sh}x{sw} grid is not divisible by window {m}",
                        f"use a window that divides {sh} and {sw}",
                    )
                )
    return out


def _hierarchy_features(role: str, s: StackSpec, what: str) -> list[Problem]:
    """What stages of windowed attention do not take: prefix tokens, GQA, QK-norm, attention positions."""
    out: list[Problem] = []
    b, at = s.block, f"{role}.block"
    last = s.total_depth - s.stage_depths[-1]  # a hierarchical stack's prefix may enter in its last stage
    prefix = "remove the class and register tokens; classify with pool: mean" + (
        f", or let them enter in the last stage: prefix.at: {last}" if s.hierarchical else ""
    )
    for key, value, hint in (
        (f"{role}.prefix", s.num_prefix and not (s.hierarchical and s.prefix_at), prefix),
        (f"{at}.kv_heads", b.kv_heads, "remove kv_heads"),
        (f"{at}.head_dim", b.head_dim, "remove head_dim; it is width / heads per stage"),
        (f"{at}.qk_norm", b.qk_norm, "set qk_norm: false"),
    ):
        if value:
            out.append(Problem(key, f"{what} does not support this", hint))
    for p in s.positions:
        if p.phase() == "attention" and p.kind != "relative_decomposed":  # computed in ViTDet's windows
            out.append(
                Problem(
                    f"{role}.position",
                    f"{what} cannot take {p.kind} positions",
                    "use none (Swin's relative bias), learned or sincos2d",
                )
            )
    for i, layer in enumerate(b.layers):
        if layer not in ("self_attention", "mlp"):
            out.append(
                Problem(
                    f"{at}.layers.{i}",
                    f"{what} has only self_attention and mlp sublayers",
                    "use layers: [self_attention, mlp]",
                )
            )
    return out


def check(spec: Spec) -> list[Problem]:
    """Every cross-field problem of a spec (empty when it is buildable).

    Args:
        spec: a spec whose fields passed validation.
    """
    out: list[Problem] = []
    needs = {"encoder": ("encoder",), "decoder": ("decoder",), "encoder_decoder": ("encoder", "decoder")}[
        spec.model
    ]
    for role in ("encoder", "decoder"):
        present = getattr(spec, role) is not None
        if role in needs and not present:
            out.append(
                Problem(
                    role,
                    f"a model of kind {spec.model} needs {'an' if role == 'encoder' else 'a'} {role} section",
                    f"add {role}: with input, position, width, depth and block",
                )
            )
        elif role not in needs and present:
            out.append(
                Problem(
                    role,
                    f"a model of kind {spec.model} has no {role}",
                    f"remove the {role} section, or set model: encoder_decoder",
                )
            )
    if out:
        return out
    for role, stack in spec.stacks.items():
        out += _stack(role, stack, spec)

    last = spec.stacks[spec.output_stack]
    out += unless_undetermined(partial(spec.head.check, "head", last, spec))
    if spec.shared_embeddings:
        enc, dec = spec.encoder, spec.decoder
        if spec.model != "encoder_decoder" or enc is None or dec is None:
            out.append(
                Problem(
                    "shared_embeddings",
                    "shared embeddings join an encoder's and a decoder's tokens",
                    "remove shared_embeddings; for a tied lm head use head.tied",
                )
            )
        elif not (isinstance(enc.input, TokensInput) and isinstance(dec.input, TokensInput)):
            out.append(
                Problem(
                    "shared_embeddings",
                    "shared embeddings need token inputs on both stacks",
                    "set shared_embeddings: false",
                )
            )
        elif (enc.input.vocab, enc.width) != (dec.input.vocab, dec.width):
            out.append(
                Problem(
                    "shared_embeddings",
                    f"encoder embeds {enc.input.vocab}x{enc.width} but decoder {dec.input.vocab}x{dec.width}",
                    "make vocab and width equal on both stacks, or set shared_embeddings: false",
                )
            )
    return out
