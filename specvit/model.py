"""Compiled models: the base classes the generated code derives from, and generation.

A model's ``forward`` (and each stack's, block's and the head's) is generated from its graph by
:mod:`specvit.codegen`; the classes here add what is not data flow: saving, checkpointing of block
activations, weight init, and the decoding loops of :meth:`DecoderModel.generate` and
:meth:`EncoderDecoderModel.generate`. Module paths are the graph's node paths
(``encoder.blocks.0.attn``), so state_dict keys read like timm's (``encoder.blocks.0.attn.qkv.weight``).

Dim legend: B batch, S tokens, V vocab.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from specvit import argcheck
from specvit.checkpoint import save_pretrained
from specvit.nn.attention import KVCache

if TYPE_CHECKING:
    from specvit.graph.ir import ArchGraph

__all__ = [
    "MODEL_CLASSES",
    "Block",
    "DecoderModel",
    "EncoderDecoderModel",
    "EncoderModel",
    "SpecModel",
    "logits_of",
]


class Block(nn.Module):
    """Base of every generated block: one FSDP2 unit, and the unit of activation checkpointing.

    Attributes:
        checkpointing: recompute the block's activations in the backward pass (training only).
    """

    checkpointing = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(super().__call__, *args, use_reentrant=False, **kwargs)
        return super().__call__(*args, **kwargs)


class SpecModel(nn.Module):
    """A model compiled from a spec's graph. Build with :func:`specvit.build_model`.

    Attributes:
        spec: the validated spec.
        graph: the architecture graph the model was built from.
    """

    spec: Any
    graph: ArchGraph
    checks_inputs = True
    """Check every call's inputs against the spec (shapes, dtypes, token ids below the vocabulary,
    lengths within the position table) and raise :class:`~specvit.inputs.InputError` saying what was
    expected. Skipped under torch.compile, torch.export and fx tracing. The token-id check reads the ids'
    minimum and maximum (a device sync on GPUs): set ``model.checks_inputs = False`` in hot loops."""

    def __init__(self, graph: ArchGraph):
        super().__init__()
        object.__setattr__(self, "graph", graph)  # plain attributes, not modules
        object.__setattr__(self, "spec", graph.spec)

    def _check_ids(self, tokens: Tensor, arg: str, what: str) -> None:
        """Refuse token ids outside the vocabulary of the input ``arg`` (an embedding would raise IndexError).

        Args:
            tokens: the ids.
            arg: the forward argument they are for (``tokens``, ``src``, ``tgt``).
            what: how to name them in the message.
        """
        vocab = self._vocab(arg)
        if vocab is None or tokens.numel() == 0 or tokens.is_floating_point() or tokens.is_meta:
            return  # ids on the meta device hold no values: the device check names them
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= vocab:
            raise ValueError(
                f"{what} holds the id {low if low < 0 else high}, outside the vocabulary 0..{vocab - 1}"
            )

    def _vocab(self, arg: str) -> int | None:
        """The vocabulary of the token input ``arg`` (``tokens``, ``src``, ``tgt``); None if it takes no ids."""
        places = self.graph.placeholders()
        return next((self.graph[n]["p"].vocab for n in places if self.graph[n]["p"].arg == arg), None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs and not all(name in self._arguments() for name in kwargs):
            from specvit.keywords import foreign_keywords

            kwargs = foreign_keywords(self.graph, self._arguments(), kwargs)  # input_ids= is tokens=
        if self.checks_inputs:
            self._check(args, kwargs)
        return super().__call__(*args, **kwargs)

    def _arguments(self) -> tuple[str, ...]:
        """The names of the forward's arguments, in order (the generated forward's signature, read once)."""
        names = self.__dict__.get("_argument_names")
        if names is None:
            names = tuple(inspect.signature(self.forward).parameters)
            object.__setattr__(self, "_argument_names", names)
        return names

    def _check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        from specvit.inputs import check_inputs

        try:
            bound = inspect.signature(self.forward).bind(*args, **kwargs)
        except TypeError:
            return  # a wrong call: Python's own message names the arguments
        offset = bound.arguments.get("offset", 0)
        weight = next(self.parameters(), None)
        check_inputs(
            self.graph,
            dict(bound.arguments),
            offset=offset if isinstance(offset, int) and not isinstance(offset, bool) else 0,
            dtype=self._input_dtype(),
            device=None if weight is None else weight.device,
        )

    def _input_dtype(self) -> torch.dtype | None:
        """The dtype floating-point inputs must have: the weights'; None where something casts them on the
        way (autocast, FSDP2's mixed precision) or there are no floating-point weights."""
        weight = next((p for p in self.parameters() if p.is_floating_point()), None)
        if weight is None:
            return None
        try:
            if torch.is_autocast_enabled(weight.device.type):
                return None
        except RuntimeError:  # a device autocast does not know (meta): nothing computes there anyway
            return None
        fsdp = sys.modules.get("torch.distributed.fsdp")  # loaded by whoever sharded the model
        if fsdp is not None and isinstance(self, getattr(fsdp, "FSDPModule", ())):
            return None
        return weight.dtype

    @classmethod
    def from_pretrained(
        cls,
        directory: str | os.PathLike[str],
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> SpecModel:
        """Rebuild a model saved by :meth:`save_pretrained`, in eval mode (as :func:`specvit.load_pretrained`).

        Args:
            directory: the checkpoint directory (``spec.yaml`` and ``model.safetensors``).
            device: where the weights go (default CPU).
            dtype: cast the weights to this dtype (default: as stored).

        Raises:
            CheckpointError: the weights are missing or do not match the spec, or the checkpoint holds
                another kind of model than ``cls`` (``DecoderModel.from_pretrained`` of a ViT).
        """
        from specvit.checkpoint import SPEC_FILE, CheckpointError, read_checkpoint, read_weights
        from specvit.codegen.build import compile_graph
        from specvit.graph.lower import graph_of
        from specvit.spec.loader import parse_spec

        contents = read_checkpoint(directory)  # both files read once, under the checkpoint's lock
        graph = graph_of(parse_spec(contents.spec_text, source=os.path.join(directory, SPEC_FILE)))
        base = MODEL_CLASSES[graph.kind]
        if not issubclass(base, cls):
            raise CheckpointError(
                f"{directory} holds a spec with model: {graph.kind} ({base.__name__}); "
                f"{cls.__name__}.from_pretrained cannot load it, SpecModel.from_pretrained can"
            )
        model = compile_graph(graph, base, Block, dtype)  # on the meta device: nothing allocated yet
        assert isinstance(model, SpecModel)
        expected = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
        target = str(torch.device(device or "cpu"))
        state = read_weights(directory, expected, target, data=contents.weights, cast=dtype is not None)
        contents.verify()  # after the checks above, which name what differs when the spec was edited by hand
        if dtype is not None:
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        model.load_state_dict(state, strict=True, assign=True)
        return model.eval()

    def blocks(self) -> list[Block]:
        """Every block of every stack, in order."""
        return [m for m in self.modules() if isinstance(m, Block)]

    def set_checkpointing(self, enabled: bool = True) -> None:
        """Recompute block activations in the backward pass (activation checkpointing) in training.

        Args:
            enabled: on or off.
        """
        for block in self.blocks():
            block.checkpointing = enabled

    def init_weights(self) -> None:
        """(Re)initialise every parameter by the graph's convention, deterministically.

        Used after ``to_empty()`` on a meta-device build; a normal build does exactly this too, so both give
        the same weights under the same ``torch.manual_seed``.
        """
        from specvit.codegen.build import init_weights

        init_weights(self, self.graph, self.graph.init)

    def save_pretrained(
        self, directory: str | Path, *, overwrite: bool = False, state_dict: dict[str, Tensor] | None = None
    ) -> Path:
        """Write ``spec.yaml``, ``model.safetensors`` and the manifest ``checkpoint.json`` into ``directory``.

        Args:
            directory: the checkpoint directory; created if missing.
            overwrite: allow writing into a non-empty directory.
            state_dict: the weights to write (e.g. a full state dict gathered from FSDP shards);
                default ``self.state_dict()``.
        """
        return save_pretrained(self, directory, overwrite=overwrite, state_dict=state_dict)


class EncoderModel(SpecModel):
    """Encoder-only model (ViT, BERT): ``model(x)``, plus ``key_padding_mask`` for sequence inputs."""


class DecoderModel(SpecModel):
    """Decoder-only model (GPT): ``model(tokens, key_padding_mask=None, *, cache=None, offset=0)``."""

    @torch.no_grad()
    def generate(
        self,
        tokens: Tensor,
        max_new_tokens: int,
        *,
        eos_id: int | None = None,
        pad_id: int | None = None,
        temperature: float = 0.0,
        top_k: int | None = None,
        use_cache: bool = True,
        cache_window: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Continue ``tokens`` (B, T0): greedy when temperature is 0, else sampling (optionally top-k).

        Args:
            tokens: (B, T0) prompt ids.
            max_new_tokens: the most tokens to add.
            eos_id: a row stops at this id (its later positions hold ``pad_id``); stop when all rows have.
            pad_id: what fills a finished row; None = ``eos_id``.
            temperature: 0 for greedy; > 0 divides the logits before sampling.
            top_k: sample among the k most likely tokens only.
            use_cache: KV cache (one step per token) or recompute the whole sequence each step.
            cache_window: bound the KV cache: every causal self-attention layer attends to at most this many
                positions (itself included) and the cache holds at most ``cache_window - 1`` per layer
                (:class:`~specvit.nn.attention.KVCache`); for ALiBi models, the ALiBi paper's sliding-window
                evaluation. None: the layers' own windows (sliding-window layers are bounded by theirs).
            generator: random generator for sampling.

        Returns:
            (B, T0 + n) with n <= max_new_tokens.
        """
        from specvit.generate import _check_prompt, _integer, decode_loop
        from specvit.nn.program import compile_step

        _check_prompt(tokens)
        self._check_ids(tokens, "tokens", "the prompt")
        self._check((tokens,), {})
        vocab = self._vocab("tokens")
        max_new_tokens = _integer(max_new_tokens, "max_new_tokens", low=0)
        eos_id = None if eos_id is None else _integer(eos_id, "eos_id", low=0, vocab=vocab)
        pad_id = None if pad_id is None else _integer(pad_id, "pad_id", low=0, vocab=vocab)
        _fits(self, "S", tokens.shape[-1], max_new_tokens)

        def step(seq: Tensor, cache: KVCache | None, offset: int) -> Tensor:
            return logits_of(self(seq, cache=cache, offset=offset))[:, -1]  # (B, V)

        if cache_window is not None:
            KVCache(cache_window)  # its argument check, before decoding

        return decode_loop(
            step,
            lambda: KVCache(cache_window),
            tokens,
            max_new_tokens,
            eos_id=eos_id,
            pad_id=pad_id,
            temperature=temperature,
            top_k=top_k,
            use_cache=use_cache,
            generator=generator,
            stepped=(self,),
            lower=functools.partial(compile_step, self, window=cache_window),
        )


class EncoderDecoderModel(SpecModel):
    """Encoder-decoder model (Transformer): ``model(src, tgt, src_key_padding_mask, tgt_key_padding_mask)``.

    Its generated ``encode(src, ...)`` returns the memory and ``decode(tgt, memory, ...)`` the outputs.
    """

    encode: Any
    decode: Any

    @torch.no_grad()
    def generate(
        self,
        src: Tensor,
        max_new_tokens: int,
        *,
        bos_id: int,
        eos_id: int | None = None,
        pad_id: int | None = None,
        src_key_padding_mask: Tensor | None = None,
        temperature: float = 0.0,
        top_k: int | None = None,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Translate ``src``: the encoder runs once, the decoder one token at a time from ``bos_id``.

        Args:
            src: encoder input: token ids, or what the encoder's input takes (a signal, features).
            max_new_tokens: the most tokens to generate after BOS.
            bos_id: the first decoder token.
            eos_id: a row stops at this id (its later positions hold ``pad_id``); stop when all rows have.
            pad_id: what fills a finished row; None = ``eos_id``.
            src_key_padding_mask: (B, S) bool, True = padding.
            temperature: 0 for greedy, else sampling temperature.
            top_k: sample among the k most likely tokens only.
            use_cache: KV cache or full recomputation per step.
            generator: random generator for sampling.

        Returns:
            (B, 1 + n) decoder tokens, BOS first.
        """
        from specvit.generate import _check_prompt, _integer, decode_loop

        if "tgt" not in self._arguments():
            raise TypeError(
                f"generate: {self.graph.name}'s decoder reads its source shifted right "
                "(decoder.input.shifted_source), so there are no decoder tokens to generate; call model(src)"
            )
        if self._vocab("src") is not None:  # token ids; a signal (Whisper's features) is checked by _check
            _check_prompt(src)
            self._check_ids(src, "src", "src")
        vocab = self._vocab("tgt")
        bos_id = _integer(bos_id, "bos_id", low=0, high=argcheck.INT64_MAX)
        self._check_ids(torch.tensor([bos_id]), "tgt", "bos_id")
        max_new_tokens = _integer(max_new_tokens, "max_new_tokens", low=0)
        eos_id = None if eos_id is None else _integer(eos_id, "eos_id", low=0, vocab=vocab)
        pad_id = None if pad_id is None else _integer(pad_id, "pad_id", low=0, vocab=vocab)
        masks = {"src_key_padding_mask": src_key_padding_mask} if src_key_padding_mask is not None else {}
        self._check(
            (src, torch.zeros(len(src), 1, dtype=torch.long, device=src.device)), masks
        )  # device and mask checks, before encoding
        _fits(self, "S_tgt", 1, max_new_tokens)
        memory = self.encode(src, **masks)

        def step(seq: Tensor, cache: KVCache | None, offset: int) -> Tensor:
            return logits_of(self.decode(seq, memory, cache=cache, offset=offset, **masks))[:, -1]

        start = torch.full((memory.shape[0], 1), bos_id, dtype=torch.long, device=memory.device)
        return decode_loop(
            step,
            KVCache,
            start,
            max_new_tokens,
            eos_id=eos_id,
            pad_id=pad_id,
            temperature=temperature,
            top_k=top_k,
            use_cache=use_cache,
            generator=generator,
            stepped=(self.decoder, self.head),  # type: ignore[arg-type]  # generated submodules
        )


def logits_of(out: Tensor | dict[str, Tensor]) -> Tensor:
    """The logits of a model's output: the output itself, or its ``logits`` beside other outputs (an MoE
    model's ``router_loss``).

    Args:
        out: what the model returned.
    """
    return out["logits"] if isinstance(out, dict) else out


def _fits(model: SpecModel, symbol: str, start: int, new: int) -> None:
    """Refuse, before decoding, a generation that would run past the learned position table."""
    from specvit.inputs import InputError, sequence_limits

    limit = sequence_limits(model.graph)[symbol]
    if start + new > limit:
        raise InputError(
            f"generate: {start} + max_new_tokens {new} = {start + new} positions, more than {model.graph.name} "
            f"takes ({symbol} <= {limit}); ask for at most {max(limit - start, 0)} new tokens"
        )


MODEL_CLASSES: dict[str, type[SpecModel]] = {
    "encoder": EncoderModel,
    "decoder": DecoderModel,
    "encoder_decoder": EncoderDecoderModel,
}
"""The base class of a generated model, by the graph's model kind."""
