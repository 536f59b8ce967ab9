"""Reference models for parity tests: moved off their init, and their weights converted into specvit's."""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from specvit.compile import build_model
from specvit.convert import Source, convert_state_dict
from specvit.errors import SpecError
from specvit.model import SpecModel
from specvit.spec.schema import Spec


def perturbed(model: nn.Module, seed: int) -> nn.Module:
    """``model`` in eval mode with every parameter moved off its init by N(0, 0.1): zero-initialised parts
    (biases, layer scales) cannot hide a wrong mapping."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def noised(model: nn.Module, seed: int, std: float = 0.08, *, frozen: bool = True) -> nn.Module:
    """``model`` in eval mode with N(0, std) added to every weight and persistent buffer (what a checkpoint
    holds), as the import issue asks of its references.

    Args:
        model: the reference.
        seed: seeds the noise.
        std: its standard deviation.
        frozen: noise the parameters without gradient too; False keeps them as computed (the same noise is
            drawn for the others either way).
    """
    gen = torch.Generator().manual_seed(seed)
    kept = (
        {} if frozen else {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    )
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.add_(torch.randn(t.shape, generator=gen) * std)
        for name, table in kept.items():
            model.get_parameter(name).copy_(table)
    return model.eval()


def hf_noised(cls: str, config: Any, seed: int = 0, std: float = 0.08, **kwargs: Any) -> nn.Module:
    """transformers' class ``cls`` of ``config`` with seeded random weights, every weight and buffer moved by
    N(0, std) (see :func:`noised`) but its frozen tables: parameters without gradient (Whisper's, Marian's and
    Pegasus' sinusoids) are computed by HF, and by specvit, not learned, and a checkpoint holds them as computed.

    Args:
        cls: the class's name in ``transformers`` (``WhisperForConditionalGeneration``).
        config: its config.
        seed: seeds the weights and the noise.
        std: the noise's standard deviation.
        kwargs: more arguments of the class (``add_pooling_layer=False``).
    """
    return noised(hf_model(cls, config, seed, **kwargs), seed, std, frozen=False)


def hf_model(cls: str, config: Any, seed: int = 0, **kwargs: Any) -> nn.Module:
    """transformers' class ``cls`` of ``config``, its random weights seeded by ``seed`` (not yet noised).

    Args:
        cls: the class's name in ``transformers``.
        config: its config.
        seed: seeds the weights.
        kwargs: more arguments of the class.
    """
    import transformers

    torch.manual_seed(seed)
    return getattr(transformers, cls)(config, **kwargs)


def hf_config(ref: nn.Module) -> dict[str, Any]:
    """An HF model's config as its config.json holds it (``architectures`` names the class)."""
    return ref.config.to_dict() | {"architectures": [type(ref).__name__]}


def unswitched(table: Any, switched: Iterable[str], *exempt: Iterable[str]) -> list[str]:
    """The config fields a family's table reads that no test switches, less the ``exempt`` sets (sizes the
    cases set, fields that act in training only) and the fields every config has.

    Args:
        table: the family's :class:`~specvit.interop.table.Table`.
        switched: the fields the tests switch.
        exempt: sets of fields switched elsewhere or inert in eval.
    """
    from specvit.interop.table import COMMON

    left = table.fields() - set(switched) - set(COMMON)
    for fields in exempt:
        left -= set(fields)
    return sorted(left)


def check_table_defaults(table: Any, config_class: str, model_type: str, *, whole: bool = True) -> None:
    """Each field a table reads has the config class's default, and a config of no fields is the class's own.

    Args:
        table: the family's table.
        config_class: the config class's name in ``transformers`` (``WhisperConfig``).
        model_type: the family's model type.
        whole: check the spec of a config of no fields too (a config class may write derived fields in:
            Llama's num_key_value_heads, so a decoder's spec says kv_heads where a config.json leaves it out).
    """
    import transformers

    import specvit
    from specvit.interop.table import F

    defaults = getattr(transformers, config_class)()
    for key, value in table.entries().items():
        if isinstance(value, F) and value.default is not None and hasattr(defaults, value.name):
            assert value.default == getattr(defaults, value.name), (model_type, key, value.name)
    if whole:
        assert specvit.from_hf({"model_type": model_type}) == specvit.from_hf(defaults)


def check_refused(config: Mapping[str, Any], change: Mapping[str, Any], message: str) -> None:
    """``config`` is read, and ``config`` with ``change`` is refused with a SpecError saying ``message``.

    Args:
        config: a config that reads (the control).
        change: fields changed or added.
        message: text the refusal holds, taken literally.
    """
    import specvit

    specvit.from_hf(dict(config))
    with pytest.raises(SpecError, match=re.escape(message)):
        specvit.from_hf(dict(config) | dict(change))


def converted(ref: nn.Module, spec: Spec, source: Source = "hf") -> SpecModel:
    """The model of ``spec`` in eval mode, with ``ref``'s weights loaded strictly through the converter."""
    model = build_model(spec).eval()
    model.load_state_dict(convert_state_dict(ref.state_dict(), source, spec), strict=True)
    return model


def ejected_twin(spec: Mapping[str, Any], std: float) -> tuple[SpecModel, nn.Module]:
    """The model of ``spec`` with N(0, ``std``) weights (off the init, whose classifier is zero) and the
    ``Model`` of its ejected file holding the same weights, both in eval mode."""
    from specvit.compile import eject

    model = build_model(spec).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std, generator=torch.Generator().manual_seed(p.numel()))
    namespace: dict[str, Any] = {}
    exec(compile(eject(spec), "ejected.py", "exec"), namespace)
    ejected = namespace["Model"]().eval()
    ejected.load_state_dict(model.state_dict())
    return model, ejected


def timm_model(name: str, seed: int, **kwargs: Any) -> nn.Module:
    """``timm.create_model(name, **kwargs)`` with seeded random weights, perturbed (see :func:`perturbed`)."""
    import timm  # a test dependency; tests/conftest.py makes it importable on CPU-only torch

    torch.manual_seed(seed)
    return perturbed(timm.create_model(name, pretrained=False, **kwargs), seed)


def timm_parity(ref: nn.Module, seed: int = 0, batch: int = 2) -> tuple[SpecModel, float]:
    """specvit's model of ``from_timm(ref)`` with ref's weights, and the max abs difference of their outputs
    on random images of the size ``ref`` takes (fp32, eval)."""
    import specvit

    model = converted(ref, specvit.from_timm(ref), "timm")
    image = model.spec.stacks["encoder"].input
    size = (image.size, image.size) if isinstance(image.size, int) else tuple(image.size)
    images = torch.randn(batch, image.channels, *size, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        diff = (model(images) - ref(images)).abs().max().item()
    return model, diff


@contextmanager
def float64_reference() -> Iterator[None]:
    """Run an HF reference in float64 as written, minus its float32 upcasts.

    HF upcasts norms, softmaxes and attention scores to float32 for half precision (``.to(torch.float32)``,
    ``.float()``, ``softmax(..., dtype=torch.float32)``); on float64 tensors that is a downcast, which would
    cap any comparison at ~1e-7. Inside this context those casts keep float64 tensors float64; nothing else
    changes. Use it around the reference's forward only, never around specvit's.
    """
    to, to_float, softmax = torch.Tensor.to, torch.Tensor.float, torch.nn.functional.softmax

    def keep_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = to(self, *args, **kwargs)
        return self if self.dtype == torch.float64 and out.dtype == torch.float32 else out

    def keep_float(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self if self.dtype == torch.float64 else to_float(self, *args, **kwargs)

    def keep_softmax(
        x: torch.Tensor, *args: Any, dtype: torch.dtype | None = None, **kwargs: Any
    ) -> torch.Tensor:
        return softmax(x, *args, dtype=None if x.dtype == torch.float64 else dtype, **kwargs)

    torch.Tensor.to, torch.Tensor.float = keep_to, keep_float  # type: ignore[method-assign]
    torch.nn.functional.softmax = keep_softmax
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.float = to, to_float  # type: ignore[method-assign]
        torch.nn.functional.softmax = softmax


def printed_by_docs_block(doc: Path, call: str) -> str:
    """What the one ```python block of ``doc`` that holds ``call`` prints, run from the project's root
    (a table or plan the docs show must be the one their code prints).

    Args:
        doc: a Markdown file under docs/.
        call: text only that block holds, such as ``describe(``.
    """
    blocks = [b for b in re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S) if call in b]
    assert len(blocks) == 1, f"{len(blocks)} python blocks of {doc.name} hold {call}"
    printed = io.StringIO()
    namespace: dict[str, Any] = {"print": lambda *a: print(*a, file=printed)}
    with contextlib.chdir(doc.parents[1]):
        exec(blocks[0], namespace)
    return printed.getvalue().strip()


class AtenOps(TorchDispatchMode):
    """The names of the aten ops a block runs (``aten.cat``, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))
