"""Compiled models: stacks, blocks and heads assembled from an ArchGraph, plus generation.

Module paths are the graph's node paths (``encoder.blocks.0.attn``), so state_dict keys read like
timm's (``encoder.blocks.0.attn.qkv.weight``). A block runs its own graph nodes in order, reading
which tensor feeds which from the graph's edges: pre-norm and post-norm blocks differ here exactly as
they differ in the diagram.

Dim legend: B batch, N tokens (incl. prefix), S input tokens, P prefix tokens, D width, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from specvit.nn import (
    CrossKVCache,
    DropPath,
    KVCache,
    LearnedPosition,
    Pool,
    Rope,
    Rope2d,
    SinCosPosition,
    Sine2dPosition,
    TokenEmbed,
)

if TYPE_CHECKING:
    from specvit.graph.ir import ArchGraph
    from specvit.spec.schema import Spec

__all__ = [
    "Block",
    "ClassifierHead",
    "DecoderModel",
    "EncoderDecoderModel",
    "EncoderModel",
    "LMHead",
    "SharedEmbedding",
    "SharedLinear",
    "SpecModel",
    "Stack",
    "TiedLinear",
]

Builder = Callable[[str], nn.Module]  # node path -> its module
LayerCache = dict[str, KVCache | CrossKVCache]

_ATTENTION = ("self_attention", "masked_self_attention", "window_attention")


class SharedEmbedding(nn.Module):
    """Looks tokens up in another stack's embedding (shared encoder/decoder embeddings); owns no parameters.

    Args:
        source: the embedding that owns the weight.
    """

    def __init__(self, source: TokenEmbed):
        super().__init__()
        self._source = (source,)  # a tuple, so the source is not registered twice

    @property
    def source(self) -> TokenEmbed:
        return self._source[0]

    def forward(self, tokens: Tensor) -> Tensor:
        return self.source(tokens)  # (B, S, D)


class SharedLinear(nn.Module):
    """Applies another linear layer, weight and bias (CroCo's decoder_embed on the memory); owns no parameters.

    Args:
        source: the linear layer that owns the parameters.
    """

    def __init__(self, source: nn.Linear):
        super().__init__()
        self._source = (source,)  # a tuple, so the source is not registered twice

    @property
    def source(self) -> nn.Linear:
        return self._source[0]

    def forward(self, x: Tensor) -> Tensor:
        return self.source(x)  # (B, M, D_out)


class TiedLinear(nn.Module):
    """Output layer sharing the token embedding's weight: ``x @ E^T (+ bias)``.

    Args:
        source: the token embedding, (V, D).
        bias: add a learned (V,) bias.
    """

    def __init__(self, source: TokenEmbed, bias: bool = False, device: Any = None, dtype: Any = None):
        super().__init__()
        self._source = (source,)
        vocab = source.num_embeddings
        self.bias = nn.Parameter(torch.zeros(vocab, device=device, dtype=dtype)) if bias else None

    @property
    def weight(self) -> Tensor:
        return self._source[0].weight

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)  # (B, S, V)


class Block(nn.Module):
    """One residual block: the graph's nodes of ``blocks.i``, run in graph order.

    Args:
        steps: ``(name, op, {port: source name})`` per node, in execution order; the block's input is ``"in"``.
        modules: the module of each step that has one (norms, attention, MLP, layer scale).
        drop_path: stochastic-depth rate applied to every residual branch of this block.
    """

    def __init__(
        self, steps: list[tuple[str, str, dict[str, str]]], modules: dict[str, nn.Module], drop_path: float
    ):
        super().__init__()
        self.steps = steps
        for name, module in modules.items():
            self.add_module(name, module)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        memory: Tensor | None = None,
        memory_padding_mask: Tensor | None = None,
        cache: LayerCache | None = None,
        pos: Tensor | None = None,
        memory_pos: Tensor | None = None,
        memory_rope: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Run the block's steps.

        Args:
            x: (B, N, D) tokens.
            key_padding_mask: (B, N) bool, True = padding.
            rope: ``(cos, sin)`` tables of the tokens, for the self-attention's queries and keys.
            memory: (B, M, Dm) the memory read by cross-attention (and by a memory norm, if any).
            memory_padding_mask: (B, M) bool, True = padding memory token.
            cache: KV caches of the attention layers, by step name.
            pos: positions added to the queries and keys of every attention (DETR).
            memory_pos: positions added to the memory's keys in cross-attention (DETR).
            memory_rope: ``(cos, sin)`` tables of the memory tokens (CroCo); when given, cross-attention
                rotates its keys by these and its queries by ``rope``.

        Returns:
            (B, N, D).
        """
        values = {"in": x}
        if memory is not None:
            values["memory"] = memory
        out = x
        for name, op, srcs in self.steps:
            h = values[srcs["x"]]
            if op == "add":
                out = h + self.drop_path(values[srcs["branch"]])
            elif op in _ATTENTION:
                kv = cache.get(name) if cache is not None else None
                out = self._modules[name](h, key_padding_mask, rope, kv, pos)  # type: ignore[misc]
            elif op == "cross_attention":
                kv = cache.get(name) if cache is not None else None
                mem = values.get(srcs["memory"])
                assert mem is not None or kv is not None, "cross-attention needs the encoder's memory"
                q_rope = rope if memory_rope is not None else None
                out = self._modules[name](  # type: ignore[misc]
                    h, mem, memory_padding_mask, kv, pos, memory_pos, q_rope, memory_rope
                )
            else:
                out = self._modules[name](h)  # type: ignore[misc]
            values[name] = out
        return out

    def new_cache(self) -> LayerCache:
        """Empty KV caches for this block's attention layers."""
        return {
            name: (CrossKVCache() if op == "cross_attention" else KVCache())
            for name, op, _ in self.steps
            if op in (*_ATTENTION, "cross_attention")
        }


class Stack(nn.Module):
    """An encoder or decoder: embeddings, prefix tokens, positions, blocks, final norm.

    Args:
        graph: the lowered spec.
        role: ``encoder`` or ``decoder``.
        build: turns a graph node path into its module.
    """

    def __init__(self, graph: ArchGraph, role: str, build: Builder):
        super().__init__()
        g = graph.nx
        order = [n for n, a in g.nodes(data=True) if a["stack"] == role]
        top = [
            n for n in order if g.nodes[n]["module"] and g.nodes[n]["block"] is None and ".stages." not in n
        ]
        for path in top:
            self.add_module(path[len(role) + 1 :], build(path))
        stack = graph.spec.stacks[role]
        self.num_prefix = stack.num_prefix
        self.pos_first = f"{role}.pos_embed" in order and (
            f"{role}.prefix" not in order or order.index(f"{role}.pos_embed") < order.index(f"{role}.prefix")
        )
        self.pos_drop = nn.Dropout(stack.dropout.embedding) if stack.dropout.embedding > 0 else nn.Identity()
        pos = stack.position
        self.rope: nn.Module | None = None
        if pos.kind == "rope":
            self.rope = Rope(stack.head_dim, pos.base)
        elif pos.kind == "rope2d":
            # a siamese decoder's tokens are the encoder's patches, on the encoder's grid
            embed = f"{role}.patch_embed" if f"{role}.patch_embed" in g else f"{role}.encoder"
            grid = g.nodes[embed]["hparams"]["grid"]
            self.rope = Rope2d(stack.head_dim, (grid[0], grid[1]), pos.base)
        # CroCo: the memory (the encoder's output for the other image) lies on the same patch grid, so
        # cross-attention rotates its keys by the same tables as its queries
        self.siamese = g.nodes[f"{role}.input"]["hparams"]["kind"] == "siamese"
        blocks: dict[str, list[Block]] = {}  # container path ({role} or {role}.stages.s) -> its blocks
        for block in graph.blocks(role):
            prefix = block + "."
            names = [n for n in order if n.startswith(prefix)]
            # the block's input is the residual of its first add; any other outside tensor is the memory
            first_add = next(n for n in names if g.nodes[n]["op"] == "add")
            block_in = next(u for u, _, d in g.in_edges(first_add, data=True) if d["port"] == "x")
            steps = []
            for n in names:
                srcs = {  # DETR's positions arrive as arguments (pos, memory_pos), not from other steps
                    d["port"]: u
                    for u, _, d in g.in_edges(n, data=True)
                    if d["port"] not in ("pos", "memory_pos")
                }
                rel = {
                    p: u[len(prefix) :] if u.startswith(prefix) else ("in" if u == block_in else "memory")
                    for p, u in srcs.items()
                }
                steps.append((n[len(prefix) :], g.nodes[n]["op"], rel))
            modules = {n[len(prefix) :]: build(n) for n in names if g.nodes[n]["module"]}
            rate = max((g.nodes[n]["hparams"].get("drop_path", 0.0) for n in names), default=0.0)
            blocks.setdefault(block.rsplit(".blocks.", 1)[0], []).append(Block(steps, modules, rate))
        if stack.hierarchical:
            self.stages = nn.ModuleList(
                Stage(blocks[f"{role}.stages.{i}"], build(f"{role}.stages.{i}.downsample") if i else None)
                for i in range(len(stack.stage_depths))
            )
        else:
            self.blocks = nn.ModuleList(blocks[role])
        self.checkpointing = False

    @staticmethod
    def _positions(pos: nn.Module, x: Tensor, offset: int) -> Tensor:
        return pos(x, offset) if isinstance(pos, LearnedPosition | SinCosPosition) else pos(x)

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        *,
        token_type_ids: Tensor | None = None,
        memory: Tensor | None = None,
        memory_padding_mask: Tensor | None = None,
        memory_pos: Tensor | None = None,
        cache: list[LayerCache] | None = None,
        offset: int = 0,
    ) -> Tensor:
        """Embed the input and run the blocks.

        Args:
            x: images (B, C, H, W), token ids (B, S) or features (B, S, Df); for a siamese decoder, the shared
                encoder's output (B, N, De) for the second image.
            key_padding_mask: (B, S) bool, True = padding; with a cache it covers cached and new tokens.
            token_type_ids: (B, S) segment ids for stacks with token types (zeros when omitted).
            memory: (B, M, Dm) encoder output, for stacks with cross-attention (a siamese decoder projects it
                with ``memory_embed`` first).
            memory_padding_mask: (B, M) bool, True = padding memory token.
            memory_pos: (1, M, Dm) positions for the memory's keys (DETR), from :meth:`attention_pos`.
            cache: one KV cache per block (see :meth:`new_cache`), for incremental decoding.
            offset: absolute position of the first new token (the cached length).

        Returns:
            (B, N, D) tokens, prefix tokens first.
        """
        part = self._modules.get
        qk_pos = None  # added to the queries and keys of every attention (DETR), never to the tokens
        if (memory_embed := part("memory_embed")) is not None and memory is not None:
            memory = memory_embed(memory)  # (B, M, D): the memory projected by the decoder's embed (CroCo)
        if (queries := part("query_embed")) is not None:
            assert memory is not None, "a queries decoder needs the encoder's memory"
            qk_pos = queries(memory.shape[0])  # (B, N, D)
            x = torch.zeros_like(qk_pos)
        if (
            embed := part("patch_embed") or part("tok_embed") or part("feat_proj") or part("embed")
        ) is not None:
            tokens = x
            x = embed(x)  # (B, S, D)
            if (types := part("type_embed")) is not None:
                x = x + types(token_type_ids if token_type_ids is not None else torch.zeros_like(tokens))
        pos, prefix = part("pos_embed"), part("prefix")
        if isinstance(pos, Sine2dPosition):
            qk_pos, pos = pos(x), None
        if pos is not None and self.pos_first:
            x = self._positions(pos, x, offset)
        if prefix is not None:
            x = prefix(x)  # (B, P + S, D)
            if key_padding_mask is not None:
                keep = key_padding_mask.new_zeros(key_padding_mask.shape[0], self.num_prefix)
                key_padding_mask = torch.cat((keep, key_padding_mask), dim=1)  # (B, P + S)
        if pos is not None and not self.pos_first:
            x = self._positions(pos, x, offset)
        if (embed_norm := part("embed_norm")) is not None:
            x = embed_norm(x)
        x = self.pos_drop(x)
        rope = None
        if isinstance(self.rope, Rope):
            n = x.shape[1]
            cos, sin = self.rope(torch.arange(offset, offset + n, device=x.device))
            rope = cos.to(x.dtype), sin.to(x.dtype)
        elif isinstance(self.rope, Rope2d):
            cos, sin = self.rope(self.num_prefix, device=x.device)
            rope = cos.to(x.dtype), sin.to(x.dtype)
        memory_rope = rope if self.siamese else None
        for i, block in enumerate(self.all_blocks()):
            if (downsample := self._downsample.get(i)) is not None:
                x = downsample(x)
            if self.checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(
                    block,
                    x,
                    key_padding_mask,
                    rope,
                    memory,
                    memory_padding_mask,
                    None,
                    qk_pos,
                    memory_pos,
                    memory_rope,
                    use_reentrant=False,
                )
            else:
                layer_cache = cache[i] if cache is not None else None
                x = block(
                    x,
                    key_padding_mask,
                    rope,
                    memory,
                    memory_padding_mask,
                    layer_cache,
                    qk_pos,
                    memory_pos,
                    memory_rope,
                )
        if (norm := part("norm")) is not None:
            x = norm(x)
        return x

    def attention_pos(self, x: Tensor) -> Tensor | None:
        """The positions this stack adds to every attention's keys (DETR's sine2d) for its output x, or None."""
        pos = self._modules.get("pos_embed")
        return pos(x) if isinstance(pos, Sine2dPosition) else None

    def _stages(self) -> list[Stage]:
        stages = self._modules.get("stages")
        return [st for st in stages if isinstance(st, Stage)] if isinstance(stages, nn.ModuleList) else []

    def all_blocks(self) -> list[Block]:
        """Every block, in order (across stages for hierarchical stacks)."""
        if self._stages():
            return [blk for stage in self._stages() for blk in stage.blocks if isinstance(blk, Block)]
        return [blk for blk in self.blocks if isinstance(blk, Block)]

    @property
    def _downsample(self) -> dict[int, nn.Module]:
        """Block index -> the patch merging that runs before it (the first block of each later stage)."""
        out, start = {}, 0
        for stage in self._stages():
            if stage.downsample is not None:
                out[start] = stage.downsample
            start += len(stage.blocks)
        return out

    def new_cache(self) -> list[LayerCache]:
        """Empty KV caches, one per block."""
        return [block.new_cache() for block in self.all_blocks()]


class Stage(nn.Module):
    """One stage of a hierarchical stack: an optional downsampling (patch merging), then blocks.

    Args:
        blocks: the stage's blocks.
        downsample: the patch merging that opens the stage, or None for the first stage.
    """

    def __init__(self, blocks: list[Block], downsample: nn.Module | None):
        super().__init__()
        self.downsample = downsample
        self.blocks = nn.ModuleList(blocks)


class ClassifierHead(nn.Module):
    """Pool, optional norm, dropout, linear classifier.

    Args:
        pool: the pooling.
        norm: norm before the classifier, or None.
        fc: the classifier.
        dropout: dropout before the classifier.
    """

    def __init__(self, pool: Pool, norm: nn.Module | None, fc: nn.Module, dropout: float):
        super().__init__()
        self.pool = pool
        if norm is not None:
            self.norm = norm
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.fc = fc

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        x = self.pool(x, key_padding_mask)  # (B, D)
        if (norm := self._modules.get("norm")) is not None:
            x = norm(x)
        return self.fc(self.drop(x))  # (B, classes)


class DetectionHead(nn.Module):
    """DETR's per-query outputs: ``{"logits": (B, N, classes + 1), "boxes": (B, N, 4)}``.

    Args:
        class_embed: the class logits layer.
        bbox_embed: the box MLP (sigmoid outputs, (cx, cy, w, h) in [0, 1]).
    """

    def __init__(self, class_embed: nn.Module, bbox_embed: nn.Module):
        super().__init__()
        self.class_embed = class_embed
        self.bbox_embed = bbox_embed

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> dict[str, Tensor]:
        return {"logits": self.class_embed(x), "boxes": self.bbox_embed(x)}


class LMHead(nn.Module):
    """A linear layer on every token: vocabulary logits (lm head) or pixels per patch (patches head).

    Args:
        fc: the output layer, (D -> V) and possibly tied to the token embedding, or (D -> p*p*C).
    """

    def __init__(self, fc: nn.Module):
        super().__init__()
        self.fc = fc

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        return self.fc(x)  # (B, S, V) or (B, N, p*p*C)


class SpecModel(nn.Module):
    """A model compiled from a spec's graph. Build with :func:`specvit.build_model`.

    Attributes:
        spec: the validated spec.
        graph: the architecture graph the model was built from.
    """

    spec: Spec
    graph: ArchGraph
    encoder: Stack
    decoder: Stack

    def __init__(self, graph: ArchGraph, build: Builder):
        super().__init__()
        object.__setattr__(self, "graph", graph)  # plain attributes, not modules
        object.__setattr__(self, "spec", graph.spec)
        for role in graph.spec.stacks:
            self.add_module(role, Stack(graph, role, build))
        g = graph.nx
        self.head: nn.Module | None = None
        if "head.class_embed" in g:
            self.head = DetectionHead(build("head.class_embed"), build("head.bbox_embed"))
        if "head.fc" in g:
            fc = build("head.fc")
            if "head.pool" in g:
                hp = g.nodes["head.pool"]["hparams"]
                norm = build("head.norm") if "head.norm" in g else None
                self.head = ClassifierHead(
                    Pool(hp["pool"], hp["num_prefix"]), norm, fc, g.nodes["head.fc"]["hparams"]["dropout"]
                )
            else:
                self.head = LMHead(fc)

    def set_checkpointing(self, enabled: bool = True) -> None:
        """Recompute block activations in the backward pass (activation checkpointing) in training.

        Args:
            enabled: on or off.
        """
        for stack in (self._modules.get("encoder"), self._modules.get("decoder")):
            if isinstance(stack, Stack):
                stack.checkpointing = enabled

    def _head(self, x: Tensor, key_padding_mask: Tensor | None) -> Any:
        return self.head(x, key_padding_mask) if self.head is not None else x

    def init_weights(self) -> None:
        """(Re)initialise every parameter by the spec's convention (``spec.init``), deterministically.

        Used after ``to_empty()`` on a meta-device build; a normal build does exactly this too, so both give
        the same weights under the same ``torch.manual_seed``.
        """
        from specvit.compile import init_weights

        init_weights(self, self.spec.init or "vit")

    def save_pretrained(
        self, directory: str | Path, *, overwrite: bool = False, state_dict: dict[str, Tensor] | None = None
    ) -> Path:
        """Write ``spec.yaml`` and ``model.safetensors`` into ``directory``.

        Args:
            directory: the checkpoint directory; created if missing.
            overwrite: allow writing into a non-empty directory.
            state_dict: the weights to write (e.g. a full state dict gathered from FSDP shards);
                default ``self.state_dict()``.
        """
        from specvit.checkpoint import save_pretrained

        return save_pretrained(self, directory, overwrite=overwrite, state_dict=state_dict)


class EncoderModel(SpecModel):
    """Encoder-only model (ViT, BERT): ``model(x, key_padding_mask=None)``."""

    def forward(
        self, x: Tensor, key_padding_mask: Tensor | None = None, token_type_ids: Tensor | None = None
    ) -> Tensor:
        """Logits, or (B, N, D) features without a head.

        Args:
            x: images (B, C, H, W), token ids (B, S) or features (B, S, Df).
            key_padding_mask: (B, S) bool, True = padding.
            token_type_ids: (B, S) segment ids, for specs with token types.
        """
        h = self.encoder(x, key_padding_mask, token_type_ids=token_type_ids)
        mask = key_padding_mask
        if mask is not None and self.encoder.num_prefix:
            mask = torch.cat((mask.new_zeros(mask.shape[0], self.encoder.num_prefix), mask), dim=1)
        return self._head(h, mask)


class DecoderModel(SpecModel):
    """Decoder-only model (GPT): ``model(tokens, key_padding_mask=None)``."""

    def forward(
        self,
        tokens: Tensor,
        key_padding_mask: Tensor | None = None,
        *,
        cache: list[LayerCache] | None = None,
        offset: int = 0,
    ) -> Tensor:
        """Logits (B, S, V), or features without a head.

        Args:
            tokens: (B, S) token ids (or features, for a features input).
            key_padding_mask: (B, S) bool, True = padding.
            cache: KV caches from ``model.decoder.new_cache()`` for incremental decoding.
            offset: the number of tokens already in the cache.
        """
        return self._head(
            self.decoder(tokens, key_padding_mask, cache=cache, offset=offset), key_padding_mask
        )

    @torch.no_grad()
    def generate(
        self,
        tokens: Tensor,
        max_new_tokens: int,
        *,
        eos_id: int | None = None,
        temperature: float = 0.0,
        top_k: int | None = None,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Continue ``tokens`` (B, T0): greedy when temperature is 0, else sampling (optionally top-k).

        Args:
            tokens: (B, T0) prompt ids.
            max_new_tokens: the most tokens to add.
            eos_id: stop a sequence at this id (later positions are filled with it); stop when all have.
            temperature: 0 for greedy; > 0 divides the logits before sampling.
            top_k: sample among the k most likely tokens only.
            use_cache: KV cache (one step per token) or recompute the whole sequence each step.
            generator: random generator for sampling.

        Returns:
            (B, T0 + n) with n <= max_new_tokens.
        """
        from specvit.generate import decode_loop

        def step(seq: Tensor, cache: list[LayerCache] | None, offset: int) -> Tensor:
            return self(seq, cache=cache, offset=offset)[:, -1]  # (B, V)

        return decode_loop(
            step,
            self.decoder.new_cache,
            tokens,
            max_new_tokens,
            eos_id=eos_id,
            temperature=temperature,
            top_k=top_k,
            use_cache=use_cache,
            generator=generator,
        )


class EncoderDecoderModel(SpecModel):
    """Encoder-decoder model (Transformer): ``model(src, tgt, src_key_padding_mask, tgt_key_padding_mask)``."""

    def encode(self, src: Tensor, src_key_padding_mask: Tensor | None = None) -> Tensor:
        """The encoder's output, the memory (B, M, D)."""
        return self.encoder(src, src_key_padding_mask)

    def decode(
        self,
        tgt: Tensor | None,
        memory: Tensor,
        tgt_key_padding_mask: Tensor | None = None,
        memory_padding_mask: Tensor | None = None,
        *,
        cache: list[LayerCache] | None = None,
        offset: int = 0,
    ) -> Tensor:
        """Logits (B, T, V) (or features without a head) of ``tgt`` given the encoder's ``memory``.

        A decoder of learned queries (DETR) takes ``tgt=None`` and returns its head's outputs per query. A
        siamese decoder (CroCo) takes the second image (B, C, H, W) as ``tgt`` and runs the encoder on it.
        """
        if self.decoder.siamese:
            tgt = self.encoder(tgt)  # (B, N, De): the shared encoder's second pass
        h = self.decoder(
            tgt,
            tgt_key_padding_mask,
            memory=memory,
            memory_padding_mask=memory_padding_mask,
            memory_pos=self.encoder.attention_pos(memory),
            cache=cache,
            offset=offset,
        )
        return self._head(h, tgt_key_padding_mask)

    def forward(
        self,
        src: Tensor,
        tgt: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
    ) -> Any:
        """Logits (B, T, V), or decoder features without a head; DETR's ``{"logits", "boxes"}`` per query.

        A siamese decoder (CroCo) reads two images through the one encoder: ``src`` gives the memory (CroCo's
        reference view, ``img2``) and ``tgt`` the decoder's tokens (the view completed, ``img1``), so
        CroCo's ``model(img1, img2)`` is ``model(img2, img1)`` here; a patches head returns (B, N, p*p*C).

        Args:
            src: encoder input: token ids (B, S), features (B, S, Df) or images.
            tgt: decoder input (B, T), or the second image of a siamese decoder; None for learned queries.
            src_key_padding_mask: (B, S) bool, True = padding.
            tgt_key_padding_mask: (B, T) bool, True = padding.
        """
        memory = self.encode(src, src_key_padding_mask)
        return self.decode(tgt, memory, tgt_key_padding_mask, src_key_padding_mask)

    @torch.no_grad()
    def generate(
        self,
        src: Tensor,
        max_new_tokens: int,
        *,
        bos_id: int,
        eos_id: int | None = None,
        src_key_padding_mask: Tensor | None = None,
        temperature: float = 0.0,
        top_k: int | None = None,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Translate ``src``: the encoder runs once, the decoder one token at a time from ``bos_id``.

        Args:
            src: encoder input.
            max_new_tokens: the most tokens to generate after BOS.
            bos_id: the first decoder token.
            eos_id: stop a sequence at this id.
            src_key_padding_mask: (B, S) bool, True = padding.
            temperature: 0 for greedy, else sampling temperature.
            top_k: sample among the k most likely tokens only.
            use_cache: KV cache or full recomputation per step.
            generator: random generator for sampling.

        Returns:
            (B, 1 + n) decoder tokens, BOS first.
        """
        from specvit.generate import decode_loop

        memory = self.encode(src, src_key_padding_mask)

        def step(seq: Tensor, cache: list[LayerCache] | None, offset: int) -> Tensor:
            return self.decode(seq, memory, None, src_key_padding_mask, cache=cache, offset=offset)[:, -1]

        start = torch.full((memory.shape[0], 1), bos_id, dtype=torch.long, device=memory.device)
        return decode_loop(
            step,
            self.decoder.new_cache,
            start,
            max_new_tokens,
            eos_id=eos_id,
            temperature=temperature,
            top_k=top_k,
            use_cache=use_cache,
            generator=generator,
        )


MODEL_CLASSES: dict[str, type[SpecModel]] = {
    "encoder": EncoderModel,
    "decoder": DecoderModel,
    "encoder_decoder": EncoderDecoderModel,
}
