"""A family of a shared layout, as data: which config field makes which spec key, which values are refused,
which fields change nothing, and what its weights' modules are called.

A :class:`Table` is read over a shared layout (``hf_llama.py``'s Llama-like decoders): the layout gives a
base table, and a family is the base with a few entries changed (:meth:`Table.but`). Every field a config
holds is accounted for: read into the spec, checked against the values the spec states (:class:`Only`),
or listed as changing nothing the model computes (``inert``); any other field is refused, so a field a
later transformers adds never silently builds a model that computes something else.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from specvit.interop.fields import D, F, Name, Only, Renamed, count
from specvit.interop.layout import Entry, Layout, Misfit, cat, same
from specvit.interop.registry import Config, Family, family

__all__ = [
    "BARE",
    "COMMON",
    "LABELS",
    "LM",
    "NULL",
    "SEQUENCE",
    "TABLES",
    "D",
    "F",
    "Head",
    "Only",
    "Renamed",
    "Table",
    "count",
    "labels",
    "lm",
    "name_table",
    "per_token",
    "pooled",
    "register",
]

COMMON = frozenset(
    {
        "_name_or_path",
        "architectures",
        "chunk_size_feed_forward",
        "dtype",
        "torch_dtype",
        "id2label",
        "is_encoder_decoder",
        "label2id",
        "model_type",
        "output_attentions",
        "output_hidden_states",
        "problem_type",
        "return_dict",
        "transformers_version",
        "use_cache",
        "initializer_range",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "max_position_embeddings",
        "n_ctx",  # GPT-2's early name of n_positions, read by no transformers class
        "task_specific_params",  # generation settings of pipelines
        "tokenizer_class",
        "gradient_checkpointing",  # a training switch of transformers 4
        "prefix",  # a tokenizer's prefix (OPT's "</s>")
    }
)
"""Fields every transformers config may hold that change nothing a forward computes: names, token ids, the
initialiser's range, whether to return a cache, what published config.json files carry for tokenizers and
pipelines. (``max_position_embeddings`` bounds a RoPE model's length
only in HF's own checks; a learned table's size is read where a table has it.)"""


@dataclass(frozen=True)
class Head:
    """One task class of a family (``ForCausalLM``): its head in the spec, and its head's weights.

    Args:
        spec: the spec entries of the head (``{"head": "none"}``; F and D read the config).
        names: head module -> the HF one, outside the backbone (``{"head.fc": "lm_head"}``).
        tied: HF parameter -> the HF parameter it is when the head is tied (BERT's decoder bias is
            ``cls.predictions.bias``, a checkpoint holding only the latter); untied, the latter is unused.
    """

    spec: Mapping[str, Any] = field(default_factory=dict)
    names: Mapping[str, Name] = field(default_factory=dict)
    tied: Mapping[str, str] = field(default_factory=dict)


def lm(tied: bool = False, **spec: Any) -> Head:
    """A causal LM's head: a linear to the vocabulary (``lm_head``), tied to the embedding or not.

    Args:
        tied: the class's default ``tie_word_embeddings``.
        spec: more head entries, by the key under ``head.`` (``softcap=F(...)``).
    """
    entries = {"head.kind": "lm", "head.tied": F("tie_word_embeddings", tied)}
    return Head(entries | {f"head.{k}": v for k, v in spec.items()}, {"head.fc": "lm_head"})


LM = lm()


def _write_labels(n: int | None, get: Callable[[str], Any]) -> dict[str, Any]:
    return {"id2label": {str(i): f"LABEL_{i}" for i in range(n)}} if isinstance(n, int) else {}


def labels(exactly: int | None = None) -> D:
    """The number of a task head's outputs: HF's ``num_labels``, the length of ``id2label``.

    Args:
        exactly: the one count the class computes with (question answering splits its two outputs into
            start and end logits); another is refused.
    """

    def read(c: Config, spec: Mapping[str, Any]) -> int:
        names = c.get("id2label", kind=dict)
        n = len(names) if names else 2  # PreTrainedConfig's default: two labels
        if exactly is not None and n != exactly:
            raise c.refuse("id2label", names, f"the head needs exactly {exactly}", f"give {exactly} labels")
        return n

    return D(read, ("id2label",), _write_labels)


LABELS = labels()
"""A classifier's classes: ``len(id2label)``, transformers' ``num_labels`` (2 when a config names none)."""

_LAST = {"head.kind": "classifier", "head.pool": "last", "head.bias": False, "head.classes": LABELS}
SEQUENCE = Head(_LAST, {"head.fc": "score"})
"""A decoder's sequence classifier (``*ForSequenceClassification``): a linear without bias on the last token
that is not padding. HF finds padding by ``pad_token_id`` in the ids; specvit by the padding mask."""


def per_token(module: str, outputs: D | None = None) -> Head:
    """A task class whose head is one linear layer (with a bias) on every token, not tied to the embedding:
    written as an ``lm`` head of ``len(id2label)`` outputs.

    Args:
        module: the head's HF module, outside the backbone (``classifier``, ``qa_outputs``).
        outputs: the number of outputs (default :func:`labels`).
    """
    entries = {"head.kind": "lm", "head.vocab": outputs or labels(), "head.bias": True, "head.tied": False}
    return Head(entries, {"head.fc": module})


BARE = Head({"head": "none"})
"""The base model: the final features, no head."""

NULL = object()
"""A spec value written as null (a classifier's ``classes: null``), where a None leaves the key out."""


def pooled(names: Mapping[str, Name] | None = None, **spec: Any) -> Head:
    """A base model with its pooler (:attr:`Table.pooled`): a ``classifier`` head without classes, its
    ``pooler_output``, that returns the tokens too (``tokens: true``: ``last_hidden_state``).

    Args:
        names: the pooler's modules -> HF's (``{"head.ops.0": "pooler.dense"}``; a base model's keys have no
            backbone prefix).
        spec: the pooler's head entries, by the key under ``head.`` (``pool="first"``, ``ops=...``).
    """
    entries = {"head.kind": "classifier", "head.classes": NULL, "head.tokens": True}
    return Head(entries | {f"head.{k}": v for k, v in spec.items()}, dict(names or {}))


@dataclass(frozen=True)
class Table:
    """One HF family over a shared layout.

    Args:
        name: the HF classes' prefix (``Qwen2``: ``Qwen2Model``, ``Qwen2ForCausalLM``).
        model_types: the config ``model_type`` values it reads.
        role: the stack it fills (``decoder`` / ``encoder``).
        spec: dotted spec key -> an :class:`F`, a :class:`D` or a constant.
        only: fields whose other values are refused.
        inert: fields that change nothing the model computes (dropout rates; HF-only switches).
        names: specvit module (or parameter) -> the HF one(s) it is made of, concatenated in order; block
            templates use ``{i}``; names are relative to the backbone (``model.`` in a task model).
        classes: class suffix (``ForCausalLM``) -> its head; the config's ``architectures`` names the class,
            ``default`` when it names none.
        default: the class of a config that names none.
        keys: a regular expression one of its state dicts' keys matches, and no other layout's.
        ignore: regular expressions of HF buffers that are not weights (RoPE's ``inv_freq``).
        pooled: the base class (``Model``) as HF builds it by default, with its pooler (BertModel(config),
            CLIPVisionModel): a head with ``tokens: true``, read for a config whose :attr:`Config.pooler` says
            the pooler is there; None: the class has no pooler, or it is not read.
    """

    name: str
    model_types: tuple[str, ...]
    role: str
    spec: Mapping[str, Any]
    keys: str
    only: tuple[Only, ...] = ()
    inert: tuple[str, ...] = ()
    names: Mapping[str, Name] = field(default_factory=dict)
    classes: Mapping[str, Head] = field(
        default_factory=lambda: {"Model": BARE, "ForCausalLM": LM, "ForSequenceClassification": SEQUENCE}
    )
    default: str = "ForCausalLM"
    ignore: tuple[str, ...] = ()
    backbone: str = "model."
    pooled: Head | None = None

    def but(
        self,
        name: str,
        model_types: tuple[str, ...],
        spec: Mapping[str, Any] | None = None,
        *,
        drop: Sequence[str] = (),
        only: tuple[Only, ...] = (),
        inert: tuple[str, ...] = (),
        names: Mapping[str, Name] | None = None,
        classes: Mapping[str, Head] | None = None,
        keys: str | None = None,
        **fields: Any,
    ) -> Table:
        """This table with entries changed: a family of the same layout.

        Args:
            name: the family's class prefix.
            model_types: its model types.
            spec: entries added or replaced.
            drop: spec keys (and config fields of ``only``, and task classes) the family does not have.
            only: checks added or replaced (by field).
            inert: fields added to the inert ones.
            names: module names added or replaced.
            classes: task classes added or replaced.
            keys: the family's own key pattern, where its weights' names differ from the layout's.
            fields: other fields replaced whole (``backbone``, ``ignore``, ``default``).
        """
        merged = {k: v for k, v in self.spec.items() if k not in drop} | dict(spec or {})
        checks = {o.name: o for o in self.only if o.name not in drop} | {o.name: o for o in only}
        return replace(
            self,
            name=name,
            model_types=model_types,
            spec=merged,
            only=tuple(checks.values()),
            inert=self.inert + inert,
            names={**self.names, **(names or {})},
            classes={k: v for k, v in {**self.classes, **(classes or {})}.items() if k not in drop},
            keys=keys or self.keys,
            **fields,
        )

    def entries(self) -> dict[str, Any]:
        """The spec entries of the stack and of every class's head, by dotted spec key."""
        return {**self.spec, **{k: v for head in self.heads() for k, v in head.spec.items()}}

    def heads(self) -> list[Head]:
        """The head of every class, the base class's with its pooler last."""
        return [*self.classes.values(), *([self.pooled] if self.pooled else [])]

    def variants(self) -> list[tuple[str, Head, bool]]:
        """Each class's suffix, head and whether it is the base class with its pooler."""
        pooled = [("Model", self.pooled, True)] if self.pooled else []
        return [*((s, h, False) for s, h in self.classes.items()), *pooled]

    def head(self, c: Config, suffix: str) -> Head:
        """The head of class ``suffix`` read from ``c``: the base class's with its pooler where ``c`` says
        the pooler is there and the family reads it."""
        if suffix == "Model" and c.pooler and self.pooled is not None:
            return self.pooled
        return self.classes[suffix]

    def fields(self) -> set[str]:
        """The config fields the entries read, of every class (two classes may set one key: an LM head's
        ``head.tied`` read from ``tie_word_embeddings``, a token classifier's a constant)."""
        values = [*self.spec.values(), *(v for head in self.heads() for v in head.spec.values())]
        return {f for v in values if isinstance(v, (F, D)) for f in v.fields}

    def known(self) -> set[str]:
        """Every config field the table accounts for."""
        return self.fields() | {o.name for o in self.only} | set(self.inert) | COMMON

    def read(self, c: Config) -> dict[str, Any]:
        """The spec's fields made of config ``c``; an unaccounted field or a refused value raises SpecError."""
        for key in c.values:
            if key not in self.known():
                raise c.refuse(
                    key,
                    c.values[key],
                    f"specvit's {self.name} table does not read this field, so cannot say the model it builds "
                    "computes what this config describes",
                    "leave the field out if it is unset, or ask for the field to be mapped",
                )
        # a class not read is named first (T5's token classifier is no encoder-decoder)
        suffix = self._class(c)
        for o in self.only:
            c.only(o.name, o.default, o.allowed, o.why)
        head = self.head(c, suffix)
        pooler = ", with its pooler" if head is self.pooled else ""
        data: dict[str, Any] = {
            "specvit": 1,
            "name": f"{c.model_type}_from_hf",
            "description": f"{self.name} ({self.name}{suffix}{pooler}), imported from its transformers config.",
            "model": self.role,
        }
        flat: dict[str, Any] = {}
        for key, value in {**self.spec, **head.spec}.items():
            if isinstance(value, F):
                value = value.read(c)
            elif isinstance(value, D):
                value = value.read(c, flat)
            flat[key] = None if value is NULL else value
            if value is not None:
                _put(data, key, None if value is NULL else value)
        return data

    def _class(self, c: Config) -> str:
        """The suffix of the HF class the config names (``architectures``), :attr:`default` if it names none."""
        named = c.get("architectures", kind=list) or [self.name + self.default]
        allowed = [self.name + suffix for suffix in self.classes]
        if len(named) != 1 or named[0] not in allowed:
            raise c.refuse(
                "architectures",
                named,
                f"specvit reads the {self.name} classes {', '.join(allowed)}",
                f"use one of {', '.join(allowed)}",
            )
        return named[0][len(self.name) :]

    def layout(self, spec: Any, keys: Sequence[str]) -> Layout:
        """The weights' names: each specvit module (or parameter) made of its HF counterparts.

        Raises:
            Misfit: the spec's input or blocks are not this family's (its input kind, norm placement,
                parallel residual, q/k/v biases), so its names would place weights in modules that compute
                something else.
        """
        if spec.model != self.role:  # a decoder's names say nothing of an encoder-decoder's decoder
            raise Misfit(f"HF {self.name} is a {self.role} model, but spec {spec.name!r} is a {spec.model}")
        stack = spec.stacks[self.role]
        kind = self.spec.get(f"{self.role}.input.kind")
        if isinstance(kind, str) and stack.input.kind != kind:  # a CLIPModel's keys name both towers
            raise Misfit(
                f"HF {self.name} reads {kind}, but spec {spec.name!r} has {self.role}.input.kind "
                f"{stack.input.kind}"
            )
        block = stack.block
        for key, ours, default in (
            ("norm.placement", block.norm.placement, "pre"),
            ("parallel", block.parallel, False),
            ("qkv_bias", block.qkv_bias, None),  # BEiT's q and v biases, a ViT's three
        ):
            want = self.spec.get(f"{self.role}.block.{key}", default)
            ours = list(ours) if isinstance(ours, tuple) else ours
            if want is not None and not isinstance(want, (F, D)) and ours != want:
                raise Misfit(
                    f"HF {self.name} blocks have {key} {want}, but spec {spec.name!r} has "
                    f"{self.role}.block.{key} {ours}"
                )
        pre = self.backbone if any(k.startswith(self.backbone) for k in keys) else ""
        head = self._head(spec, keys)
        heads = head.names
        table = name_table(self.names, pre, heads)
        tied: dict[str, str] = {}
        ignore = self.ignore
        if getattr(spec.head, "tied", False):
            embedding, fc = self.names[f"{self.role}.tok_embed"], heads.get("head.fc")
            assert isinstance(embedding, str)
            if isinstance(fc, str):  # the weight is the embedding's; a bias stays the head's own
                tied[f"{fc}.weight"] = f"{pre}{embedding}.weight"
            tied |= head.tied
            for copy, original in head.tied.items():  # read from the parameter a checkpoint keeps
                module, _, param = copy.rpartition(".")
                ours = next(k for k, v in heads.items() if v == module)
                table[f"{ours}.{param}"] = ((original,), same)
        else:  # parameters HF's forward reads only as the tied copies'
            ignore += tuple(re.escape(original) for original in head.tied.values())
        shown = " / ".join(dict.fromkeys(f"HF {self.name}{c}" for c in (self.default, "Model")))
        return Layout(shown, table, ignore=ignore, tied=tied)

    def _head(self, spec: Any, keys: Sequence[str]) -> Head:
        """The task class whose head weights the keys hold: of several, one whose every module they hold, and
        of those the one naming the most (a pooler and a classifier over a classifier alone); with none of
        them, the class of the spec's head (a tied LM head may be left out of a checkpoint)."""

        def held(name: Name) -> bool:
            first = name.sources if isinstance(name, Renamed) else name
            first = first if isinstance(first, str) else first[0]
            return any(k.startswith(first + ".") or k == first for k in keys)

        def score(head: Head) -> tuple[bool, int]:  # all its modules held first, then the most held
            count = sum(map(held, head.names.values()))
            return 0 < count == len(head.names), count

        best = max(self.heads(), key=score)  # the first of the best
        if score(best)[1]:
            return best
        if spec.head.kind == "none":
            return BARE
        if getattr(spec.head, "tokens", False) and self.pooled is not None:  # a pooler without weights
            return self.pooled
        return self.classes[self.default]


def name_table(names: Mapping[str, Name], pre: str, heads: Mapping[str, Name]) -> dict[str, Entry]:
    """The layout's table of a family's names: each specvit module (or parameter) and each of its parameters
    (``{p}``) made of the HF ones, concatenated where there are several.

    Args:
        names: specvit name -> HF name(s), relative to the backbone.
        pre: the backbone's prefix in the state dict (``model.``, or none for a base model's).
        heads: the task head's names, outside the backbone.
    """
    table: dict[str, Entry] = {}
    for ours, name in {**names, **heads}.items():
        theirs, join = (name.sources, name.transform) if isinstance(name, Renamed) else (name, None)
        sources = (theirs,) if isinstance(theirs, str) else theirs
        sources = tuple(s if ours in heads else pre + s for s in sources)
        join = join or (cat if len(sources) > 1 else same)
        table[ours] = (sources, join)  # a parameter named whole (an MoE's stacked experts)
        table[ours + ".{p}"] = (tuple(s + ".{p}" for s in sources), join)
    return table


def _put(data: dict[str, Any], key: str, value: Any) -> None:
    """Set a dotted key in nested dicts."""
    *path, last = key.split(".")
    for part in path:
        data = data.setdefault(part, {})
    data[last] = value


TABLES: dict[str, Table] = {}
"""Model type -> its table."""


def register(table: Table) -> Table:
    """Register a table as a family ``from_hf`` and the converter find by model type and by keys."""
    TABLES.update(dict.fromkeys(table.model_types, table))
    family(Family(table.name + table.default, table.model_types, table.keys, table.read, table.layout))
    return table
