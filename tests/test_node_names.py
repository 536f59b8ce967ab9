"""Names from a spec never reach generated code unchecked: a block-graph node name that is a Python keyword
or an attribute every module has is refused when the spec is validated (it used to pass, then eject failed
with a SyntaxError and build_model with a KeyError); any other identifier builds and ejects the same model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import specvit
from specvit.errors import SpecError
from specvit.export import example_inputs
from specvit.model import Block
from specvit.spec.rules_block import BLOCK_ATTRIBUTES, reserved

SAGAN = (Path(__file__).resolve().parents[1] / "specs" / "sagan_attn1_64.yaml").read_text()


def _named(name: str) -> str:
    """The SAGAN block-graph spec with its attention node called ``name``."""
    assert "name: attn, op" in SAGAN and "inputs: [x, attn]" in SAGAN
    return SAGAN.replace("name: attn, op", f"name: {name}, op").replace(
        "inputs: [x, attn]", f"inputs: [x, {name}]"
    )


@pytest.mark.parametrize(
    ("name", "what"),
    [("def", "a Python keyword"), ("class", "a Python keyword"), ("training", "an attribute of every torch module"),
     ("forward", "an attribute of every torch module"), ("_modules", "an attribute of every torch module"),
     ("checkpointing", "an attribute of every torch module")],
)  # fmt: skip
def test_a_reserved_node_name_is_refused_at_its_line(name: str, what: str) -> None:
    with pytest.raises(SpecError) as exc:
        specvit.parse_spec(_named(name))
    assert str(exc.value).splitlines()[0] == (
        f"<string>:20:16: encoder.block.graph.0.name: '{name}' is {what} (rename it, e.g. {name}_)"
    )


def test_the_reserved_names_cover_the_generated_block() -> None:
    assert set(dir(Block)) - set(dir(nn.Module)) <= BLOCK_ATTRIBUTES
    assert all(map(reserved, dir(nn.Module())))
    assert not reserved("attn") and not reserved("self")


@pytest.mark.parametrize("name", ["self", "torch", "F", "nn", "input", "mask", "match", "super", "x_"])
def test_any_other_identifier_builds_and_ejects_the_same_model(name: str) -> None:
    spec = specvit.parse_spec(_named(name))
    torch.manual_seed(0)
    model = specvit.build_model(spec).eval()
    namespace: dict[str, object] = {}
    exec(compile(specvit.eject(spec), "ejected.py", "exec"), namespace)
    ejected = namespace["Model"]().eval()  # type: ignore[operator]
    ejected.load_state_dict(model.state_dict())
    (x,) = example_inputs(model, batch=2)
    with torch.no_grad():
        assert torch.equal(model(x), ejected(x))


@pytest.mark.parametrize("name", ['a"""b.yaml', "C:\\Users\\x.yaml", "tab\there\\N{x}.yaml", "quote'\".yaml"])
def test_a_spec_path_reaches_the_ejected_docstring_as_text(name: str, tmp_path: Path) -> None:
    """The path the spec came from is quoted into the file's docstring: it compiles and reads back as the path
    (a path holding \"\"\" ended the docstring, and a Windows path made an invalid \\U escape)."""
    path = tmp_path / name
    path.write_text(SAGAN)
    namespace: dict[str, object] = {}
    exec(compile(specvit.eject(path), "ejected.py", "exec"), namespace)
    assert str(namespace["__doc__"]).splitlines()[0] == f"sagan_attn1_64, ejected by specvit from {path}."
