"""The text around an ejected file's code: its header, class docstrings naming the spec lines each class
came from, ``generate()``, and the final layout (formatted as ruff formats, line length 110).
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable

from specvit.codegen.lines import WIDTH
from specvit.codegen.scopes import Scope, block_container
from specvit.graph.ir import ArchGraph

__all__ = ["class_doc", "container_source", "format_file", "generate_source", "spec_note", "with_doc"]

_CONTAINER = '''
def _container(**children: nn.Module) -> nn.Module:
    """A module that only holds others (a stage of blocks, a downsampling step)."""
    module = nn.Module()
    for name, child in children.items():
        module.add_module(name, child)
    return module
'''


def container_source() -> str:
    """The helper that builds a module holding others (a stage of blocks)."""
    return _CONTAINER.strip() + "\n"


def _line(source: str) -> int | None:
    """The line of a node's ``source`` (``file:line:col``), or None."""
    parts = source.rsplit(":", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def spec_note(graph: ArchGraph, paths: list[str]) -> str:
    """Where in the spec the nodes ``paths`` come from: ``spec: encoder.block.layers.0, line 16``, or for
    many keys their common prefix and the range of lines (``spec: encoder.block, lines 16-18``)."""
    found: dict[str, int] = {}
    for p in paths:
        a = graph[p]
        line = _line(str(a.get("source", "")))
        if line is not None and a.get("spec_key"):
            found.setdefault(str(a["spec_key"]), line)
    if not found:
        return ""
    keys = sorted(found, key=lambda k: (found[k], k))
    if len(keys) <= 2 and len(set(found.values())) == len(keys):
        return "spec: " + "; ".join(f"{k}, line {found[k]}" for k in keys)
    prefix = _common_prefix(keys)
    lines = sorted(set(found.values()))
    where = f"line {lines[0]}" if len(lines) == 1 else f"lines {lines[0]}-{lines[-1]}"
    return f"spec: {prefix}, {where}" if prefix else f"spec {where}"


def _common_prefix(keys: list[str]) -> str:
    parts = [k.split(".") for k in keys]
    common = []
    for items in zip(*parts, strict=False):
        if len(set(items)) != 1:
            break
        common.append(items[0])
    return ".".join(common)


def _docstring(summary: str, note: str, indent: str = "    ") -> str:
    """A docstring: one line when the summary and the note fit, else the summary, a blank line, the note."""
    summary = summary.rstrip(".")
    one = f'{indent}"""{summary} ({note})."""' if note else f'{indent}"""{summary}."""'
    if len(one) <= WIDTH:
        return one
    literal = re.compile(r"``.*?``")  # ``start + offset .. N - 1`` is not broken across lines
    glued = literal.sub(lambda m: m.group(0).replace(" ", "\0"), f"{summary}.")
    body = [line.replace("\0", " ") for line in textwrap.wrap(glued, WIDTH - len(indent) - 3)]
    lines = [f'{indent}"""{body[0]}', *(indent + b for b in body[1:])]
    if note:
        lines += ["", f"{indent}{note[0].upper()}{note[1:]}."]
    return "\n".join([*lines, f'{indent}"""'])


def _summary(doc: str) -> str:
    """The first sentence of a docstring."""
    first = " ".join(doc.strip().split("\n\n")[0].split())
    for match in re.finditer(r"(?<!\.)\.(?=\s|$)", first):  # a full stop, not an ellipsis's ``a .. b``
        sentence = first[: match.end()]
        if sentence.count("``") % 2 == 0:  # not inside ``literal text``
            return sentence
    return first


def with_doc(source: str, note: str) -> str:
    """A class's source with its docstring replaced by its first sentence and ``note``."""
    klass = ast.parse(source).body[0]
    assert isinstance(klass, ast.ClassDef)
    doc = ast.get_docstring(klass) or klass.name
    lines = source.splitlines()
    first = klass.body[0]
    has_doc = ast.get_docstring(klass) is not None
    new = _docstring(_summary(doc), note).splitlines()
    if has_doc:
        lines[first.lineno - 1 : first.end_lineno] = new
    else:
        lines[klass.lineno : klass.lineno] = [*new, ""]
    return "\n".join(lines) + "\n"


def class_doc(graph: ArchGraph, scope: str, children: list[str], scopes: dict[str, Scope]) -> str:
    """The docstring of a generated class: what it is, what it holds, and its spec lines."""
    parts = ", ".join(children)
    if not scope:
        kind = graph.kind.replace("_", "-")
        summary = f"{graph.name}, {'an' if kind[0] in 'aeiou' else 'a'} {kind} model: {parts}"
    elif (container := block_container(scope)) is not None:
        summary = f"A block of the {container[0].split('.')[0]}: {parts}"
    else:
        summary = f"The {scope}: {parts}"
    inside = [n for n in graph.nx if _within(graph.nx.nodes[n]["scope"], scope)]
    return _docstring(summary, spec_note(graph, inside))


def _within(s: str, scope: str) -> bool:
    return not scope or s == scope or s.startswith(scope + ".")


def generate_source(graph: ArchGraph, template: str | None) -> list[str]:
    """The ``generate`` method of a decoder's or an encoder-decoder's ``Model``, indented for its class body
    (none for an encoder): the template's text, reading the ``logits`` entry of a model returning several."""
    if template is None:
        return []
    output = graph[graph.output]["p"]
    if getattr(output, "keys", ()):  # a dict of outputs: the logits are one
        template = re.sub(r"\)  # \(B, (T|1), V\)", r')["logits"]  # (B, \1, V)', template)
    return [textwrap.indent(template.strip(), "    ")]


def _header(graph: ArchGraph, origin: str, generates: bool) -> str:
    # the path is the user's text: backslashes, quotes and control characters written as escapes, so no file
    # name ('a"""b.yaml', 'C:\\Users\\x.yaml') can end the docstring or make an invalid escape
    shown = origin.encode("unicode_escape").decode("ascii").replace('"', '\\"')
    where = f" from {shown}" if origin else ""
    lines = [
        f'"""{graph.name}, ejected by specvit{where}.',
        "",
        "Plain PyTorch: ``Model()`` builds it, ``model.load_state_dict(compiled.state_dict())`` loads a compiled",
        "model's weights, and then it computes the same outputs.",
    ]
    if generates:
        lines.append("``model.generate(...)`` decodes greedily, or samples with ``do_sample=True``.")
    return "\n".join([*lines, '"""'])


def format_file(
    graph: ArchGraph,
    origin: str,
    body: list[str],
    imports: set[str],
    import_block: Callable[[str, set[str]], str],
    use_ruff: bool = True,
) -> str:
    """The ejected file: header, imports, then the definitions, two blank lines apart; through ``ruff format``
    when ruff is installed (a no-op on what specvit writes, which is formatted already)."""
    code = "\n\n\n".join(part.strip() for part in body if part.strip()) + "\n"
    gap = "\n\n\n" if code.startswith(("class ", "def ", "@")) else "\n\n"  # isort's lines after imports
    text = f"{_header(graph, origin, 'def generate(' in code)}\n\nfrom __future__ import annotations\n\n{import_block(code, imports)}{gap}{code}"
    return ruff_format(text) if use_ruff else text


def ruff_format(text: str) -> str:
    """``text`` through ``ruff format --line-length 110`` when ruff is importable; else as it is."""
    if importlib.util.find_spec("ruff") is None:
        return text
    run = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--isolated", f"--line-length={WIDTH}", "-"],
        input=text,
        capture_output=True,
        text=True,
        check=False,
    )
    return run.stdout if run.returncode == 0 and run.stdout else text
