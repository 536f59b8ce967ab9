"""The ``specvit`` command line: validate, summary, diff, presets, schema, render, export, eject.

Every problem in a spec is printed as ``file:line:col: key.path: message (hint)`` and the command exits with
status 2, never a traceback. ``validate`` and ``schema`` do not import torch. Everything printed passes through
:func:`_say`, which escapes control characters (ANSI sequences) from the input, so no spec, file name or
checkpoint can write to the terminal."""

from __future__ import annotations

import sys


def _interrupted(command: str) -> int:
    """Ctrl-C: one line, and 130 (128 + SIGINT). An interrupt through an ``exec`` of a string (dataclasses make
    methods so) stays marked unhandled once caught, so ``python -m`` ended by SIGINT: a string run clears it."""
    sys.stderr.write(f"{command}: interrupted\n")
    exec("pass")
    return 130


try:  # Ctrl-C while the command starts (its first tenth of a second), as once main() runs
    import argparse
    import json
    from collections.abc import Sequence
    from typing import TYPE_CHECKING, Any, NoReturn

    from specvit import __version__
    from specvit.arguments import (
        add_json,
        add_macs,
        add_quiet,
        add_set,
        add_sizes,
        add_view,
        at_least_2,
        positive,
    )
    from specvit.commands import add_import, add_serve, cmd_presets
    from specvit.errors import CheckpointError, MissingDependencyError, Problem, SpecError, SpecFileError
    from specvit.process import describe, named_stdout
    from specvit.text import escape
    from specvit.units import flop_unit
except KeyboardInterrupt:
    raise SystemExit(_interrupted("specvit")) from None

if TYPE_CHECKING:
    from specvit.spec import Spec

EXIT_IO_ERROR = 1  # a file cannot be read or written
EXIT_SPEC_ERROR = 2  # the spec is invalid
EXIT_USAGE = 2  # the command line is wrong (as argparse exits)


def _say(text: object, *, err: bool = False) -> None:
    """Print ``text`` with every control character but the line breaks escaped (``\\x1b``)."""
    print("\n".join(escape(line) for line in str(text).split("\n")), file=sys.stderr if err else sys.stdout)


def _load(path: str, sets: list[str]) -> Spec:
    from specvit.spec import load_spec, parse_overrides

    return load_spec(path, overrides=parse_overrides(sets))


def cmd_validate(args: argparse.Namespace) -> int:
    results: list[dict[str, Any]] = []
    for path in args.specs:
        try:
            spec = _load(path, args.set)
        except SpecError as exc:
            kind = "unreadable" if isinstance(exc, SpecFileError) else "invalid"
            results.append({"spec": path, "status": kind, "problems": [_problem(p) for p in exc.problems]})
            if not args.json:
                _say(str(exc), err=True)
            continue
        results.append({"spec": path, "status": "ok", "name": spec.name, "summary": spec.summary_line()})
        if not args.json:
            _say(f"ok  {spec.summary_line()}")
    if args.json:
        print(json.dumps(results, indent=2))
    statuses = {r["status"] for r in results}
    if "invalid" in statuses:
        return EXIT_SPEC_ERROR
    return EXIT_IO_ERROR if "unreadable" in statuses else 0


def _problem(p: Problem) -> dict[str, Any]:
    loc = p.location
    where = (
        {"file": loc.file, "line": loc.line, "col": loc.col} if loc else {"file": None, "line": 0, "col": 0}
    )
    return {**where, "path": p.path, "message": p.message, "hint": p.hint, "text": str(p)}


def cmd_schema(args: argparse.Namespace) -> int:
    from specvit.spec.json_schema import json_schema

    text = json.dumps(json_schema(), indent=2) + "\n"
    if args.output:
        from specvit.io import atomic_write

        atomic_write(args.output, text)
        _say(f"wrote {args.output}")
    else:
        sys.stdout.write(text)
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from specvit.diagram.diff import diff_graphs, diff_json, format_diff, highlight, marked
    from specvit.diagram.graphviz import ENGINE_FORMATS, RenderError, draw_dot, to_dot
    from specvit.graph import build_graph
    from specvit.io import atomic_write, refuse_inputs, spec_inputs

    spec_a, spec_b = _load(args.a, []), _load(args.b, args.set)
    if args.output:  # never over A or B (or a base they extend), as render, eject and export refuse
        refuse_inputs(args.output, {**spec_inputs(spec_b), **spec_inputs(spec_a)})
    a, b = build_graph(spec_a, **_sizes(args)), build_graph(spec_b, **_sizes(args))
    rows, unit = diff_graphs(a, b), flop_unit(args.macs)
    if args.json:
        print(json.dumps(diff_json(a, b, rows, unit), indent=2))
    else:
        print(format_diff(a, b, rows, unit))
    if args.output:
        dot = highlight(to_dot(b, args.view, "TB", unit=unit), marked(rows, b, args.view))
        suffix = args.output.rsplit(".", 1)[-1].lower()
        try:
            if suffix == "dot":
                atomic_write(args.output, dot)
            elif f".{suffix}" in ENGINE_FORMATS:
                draw_dot(dot, args.output)
            else:
                _usage(args, f"-o {args.output}: the diagram is written as .svg, .png, .pdf or .dot")
        except RenderError as exc:
            print(f"specvit diff: {exc}", file=sys.stderr)
            return EXIT_IO_ERROR
        print(f"wrote {args.output} (B, with the nodes that differ by their own settings outlined in red)",
              file=sys.stderr)  # fmt: skip
    return 0


def _sizes(args: argparse.Namespace) -> dict[str, int]:
    return {
        k: v for k in ("batch", "seq_len", "src_len", "tgt_len") if (v := getattr(args, k, None)) is not None
    }


def cmd_summary(args: argparse.Namespace) -> int:
    from specvit.diagram.text import format_table
    from specvit.graph import build_graph

    spec = _load(args.spec, args.set)
    if (args.tp, args.pp, args.dp) != (1, 1, 1) or args.fsdp:
        return _layout(spec, args)
    graph = build_graph(spec, **_sizes(args))
    expand, unit = args.view == "expanded", flop_unit(args.macs)
    if args.json:
        data = {
            "name": graph.name,
            "dims": graph.dims,
            "unit": unit.meaning,
            "total_params": graph.total_params,
            f"total_{unit.key}": unit.of(graph.total_flops),
            f"total_useful_{unit.key}": unit.of(graph.total_useful_flops),
            "rows": [r.as_dict(unit) for r in graph.summary(expand=expand)],
        }
        print(json.dumps(data, indent=2))
    else:
        _say(format_table(graph, expand=expand, unit=unit))
    return 0


def _layout(spec: Any, args: argparse.Namespace) -> int:
    """``summary --tp/--pp/--dp``: what each rank of that layout holds and sends per training step."""
    from dataclasses import asdict

    from specvit.parallel_layout import layout_report

    report = layout_report(spec, tp=args.tp, pp=args.pp, dp=args.dp, fsdp=args.fsdp, **_sizes(args))
    _say(json.dumps(asdict(report), indent=2) if args.json else report.table())
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from specvit.diagram import RenderError, render

    try:
        spec: Any = _load(args.spec, args.set)
        written = render(
            spec,
            args.output,
            view=args.view,
            direction=args.direction,
            dpi=args.dpi,
            flops=args.flops,
            macs=args.macs,
            plumbing=args.plumbing,
            pp=args.pp,
        )
    except RenderError as exc:
        _say(f"specvit render: {exc}", err=True)
        return EXIT_IO_ERROR
    _say(f"wrote {written}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    if not args.checkpoint and not args.spec:
        _usage(args, "give a SPEC or --checkpoint DIR")
    if args.checkpoint and args.spec:
        _usage(args, "give a SPEC or --checkpoint DIR, not both")
    import os

    from specvit.checkpoint import MANIFEST_FILE, SPEC_FILE, WEIGHTS_FILE
    from specvit.compile import build_model, load_pretrained
    from specvit.export import example_inputs, export_onnx
    from specvit.inputs import dynamic_axes
    from specvit.io import refuse_inputs, spec_inputs

    if args.checkpoint:
        names = (SPEC_FILE, WEIGHTS_FILE, MANIFEST_FILE)
        refuse_inputs(args.output, {os.path.join(args.checkpoint, n): f"the checkpoint's {n}" for n in names})
        model = load_pretrained(args.checkpoint)
    else:
        from specvit.graph import build_graph

        spec = _load(args.spec, args.set)
        refuse_inputs(args.output, spec_inputs(spec))
        try:  # refuses huge inputs before the build
            example_inputs(build_graph(spec), batch=args.batch, device="meta", seq_len=args.seq_len)
        except SpecError:
            raise
        except ValueError as exc:
            _usage(args, f"argument --seq-len: {exc}")
        model = build_model(spec)
    try:
        inputs = example_inputs(model, batch=args.batch, seq_len=args.seq_len)
    except ValueError as exc:
        _usage(args, f"argument --seq-len: {exc}")
    written = export_onnx(model, args.output, inputs, progress=False if args.quiet else None)
    axes = sorted({name for named in dynamic_axes(model.graph).values() for name in named.values()})
    _say(f"wrote {written} (dynamic: {', '.join(axes)})")
    return 0


def cmd_eject(args: argparse.Namespace) -> int:
    from specvit.compile import eject
    from specvit.io import refuse_inputs, spec_inputs

    spec = _load(args.spec, args.set)
    refuse_inputs(args.output, spec_inputs(spec))
    eject(spec, args.output)
    _say(f"wrote {args.output} (standalone PyTorch: Model() builds it)")
    return 0


def _usage(args: argparse.Namespace, message: str) -> NoReturn:
    """Exit with a usage error of the subcommand (its usage line, then ``specvit CMD: error: ...``; status 2).

    Args:
        args: the parsed arguments (they carry their subcommand's parser).
        message: what is wrong.
    """
    parser: argparse.ArgumentParser = args.parser
    parser.error(message)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``specvit`` command."""
    parser = argparse.ArgumentParser(
        prog="specvit",
        description="Compile YAML specs of attention models into diagrams and PyTorch modules.",
        epilog="Spec reference: docs/spec.md. Exit status: 0 ok; 1 a file cannot be read or written; "
        "2 an invalid spec, or a usage error (named for its subcommand).",
    )
    parser.add_argument("--version", action="version", version=f"specvit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_reading(sub)
    _add_writing(sub)
    for command in sub.choices.values():
        command.set_defaults(parser=command)  # usage errors found after parsing name their subcommand
    return parser


def _add_reading(sub: Any) -> None:
    """The subcommands that read specs and print: validate, summary, diff, presets, schema."""
    p = sub.add_parser(
        "validate",
        help="check specs; print one line per valid spec",
        description="Validate spec files. Prints one line per valid spec; on any error prints "
        "every problem as file:line:col: key: message (hint) and exits 2.",
    )
    p.add_argument("specs", nargs="+", metavar="SPEC", help="spec files (.yaml) or preset names")
    add_json(p)
    add_set(p)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser(
        "summary",
        help="table of modules: path, op, output shape, params, FLOPs",
        description="Print every module of the model with its output shape, parameter count and FLOPs "
        "(a multiply-add counts 2, as torch's FlopCounterMode counts; --macs prints multiply-adds), with "
        "totals at the sizes they were counted at. Attention under a causal mask or a sliding window is "
        "counted as a dense kernel computes it (all S x S query-key pairs) and, in a column of its own, as "
        "the useful part (the pairs the mask keeps). Identical blocks fold into one row with a count.",
    )
    p.add_argument("spec", metavar="SPEC", help="spec file (.yaml) or preset name")
    add_sizes(p)
    add_macs(p)
    add_view(p, "folded into one row")
    p.add_argument(  # the spelling before --view, kept working for scripts; not shown in --help
        "--expand", dest="view", action="store_const", const="expanded", help=argparse.SUPPRESS
    )
    g = p.add_argument_group(
        "a parallel layout: per pipeline stage, what a rank holds (parameters, gradients and AdamW states, "
        "activations at --batch per data rank) and sends per training step"
    )
    g.add_argument("--tp", type=positive, default=1, metavar="N", help="tensor-parallel ranks")
    g.add_argument(
        "--pp", type=positive, default=1, metavar="N", help="pipeline stages (1F1B, N microbatches)"
    )
    g.add_argument("--dp", type=positive, default=1, metavar="N", help="data-parallel ranks")
    g.add_argument("--fsdp", action="store_true", help="shard the data-parallel ranks with FSDP2 (else DDP)")
    add_json(p)
    add_set(p)
    p.set_defaults(func=cmd_summary)

    p = sub.add_parser(
        "diff",
        help="what changes between two specs, node by node and setting by setting, with deltas",
        description="Compare two specs (files or preset names) node by node: every resolved setting of "
        "every node (heads, head_dim, activation, eps, norms, pooling, windows, positions, biases, dropout "
        "and drop-path rates; the init convention as the row 'model'), its output shape, parameters, FLOPs "
        "and inputs. Each row says what changed ('heads 12 -> 8'): changed (its own settings), reshaped "
        "(only its shape or FLOPs, from a change upstream), rewired (other inputs; norm placement), added "
        "or removed; runs of blocks that change alike fold into one row; totals and deltas first. No row "
        "means the same model. --set changes B, so 'specvit diff X X --set encoder.depth=6' shows what an "
        "override does. --json prints each row's fields before and after. -o draws B's diagram with the "
        "changed, rewired and added nodes outlined.",
    )
    p.add_argument("a", metavar="A", help="the spec before")
    p.add_argument("b", metavar="B", help="the spec after")
    p.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="also draw B with the nodes that differ by their own settings outlined (.svg .png .pdf .dot)",
    )
    add_view(p, "drawn")
    add_json(p)
    add_sizes(p)
    add_macs(p)
    add_set(p)
    p.set_defaults(func=cmd_diff)

    _add_presets(sub)

    p = sub.add_parser(
        "schema",
        help="print the JSON Schema of the spec language",
        description="Print the JSON Schema of specs, for editors' YAML language servers (see docs/guide.md).",
    )
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of standard output")
    p.set_defaults(func=cmd_schema)


def _add_presets(sub: Any) -> None:
    """The ``presets`` subcommand: the bundled presets with their sizes."""
    p = sub.add_parser(
        "presets",
        help="list the bundled presets with their parameter counts and FLOPs",
        description="List the bundled presets: name, model kind, parameters, FLOPs (useful FLOPs beside: "
        "without the attention pairs a causal mask or a sliding window hides) at the sizes given under 'at' "
        "(summary's defaults) and description. Every command "
        "and specvit.load_spec take a preset's name where they take a spec file, and a spec may write "
        "extends: NAME.yaml to start from one.",
    )
    add_json(p)
    add_macs(p)
    p.set_defaults(func=cmd_presets)


def _add_writing(sub: Any) -> None:
    """The subcommands that write files: render, export, eject."""
    p = sub.add_parser(
        "render",
        help="draw the architecture diagram (svg, png, pdf, dot, mmd, html)",
        description="Draw the model's graph. The format comes from the extension of -o: .svg, .png, .pdf "
        "(Graphviz, through pygraphviz or the system dot), .dot (Graphviz source), .mmd (Mermaid, for "
        "Markdown pages) or .html (an interactive page: folded blocks expand, a click shows a node's shapes, "
        "parameters, FLOPs, settings and spec line, a search box finds nodes by path; self-contained, it "
        "fetches nothing). The file is written whole or not at all.",
    )
    p.add_argument("spec", metavar="SPEC", help="spec file (.yaml) or preset name")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="the file to write")
    add_view(p, "drawn")
    p.add_argument(
        "--direction", choices=["TB", "LR"], default="TB", help="top-to-bottom (default) or left-to-right"
    )
    p.add_argument("--dpi", type=positive, metavar="N", help="resolution of a .png (default 96)")
    p.add_argument(
        "--flops",
        action="store_true",
        help="write each node's FLOPs beside its parameters (and the useful part of a masked attention's)",
    )
    p.add_argument(
        "--plumbing",
        action="store_true",
        help="also draw the run-time plumbing: padding masks, the KV cache and the decoding offset, with "
        "their edges into every attention (left out by default)",
    )
    p.add_argument("--pp", type=positive, metavar="M", help="frame M pipeline stages (as `summary --pp M`)")
    add_macs(p)
    add_set(p)
    p.set_defaults(func=cmd_render)

    p = sub.add_parser(
        "export",
        help="export the model to ONNX (batch and sequence dimensions dynamic)",
        description="Build the model (random weights, or a checkpoint's) and export its forward to ONNX with "
        "torch.onnx's dynamo exporter. The batch and sequence dimensions stay dynamic (named batch, seq_len, "
        "src_len, tgt_len in the file), each up to what the model takes; image sizes are fixed by the spec.",
    )
    p.add_argument(
        "spec",
        metavar="SPEC",
        nargs="?",
        help="spec file (.yaml) or preset name; not needed with --checkpoint",
    )
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="the .onnx file to write")
    p.add_argument("--checkpoint", metavar="DIR", help="a save_pretrained directory whose weights to export")
    p.add_argument(
        "--batch", type=at_least_2, default=2, metavar="N", help="batch of the example input (default 2)"
    )
    p.add_argument(
        "--seq-len",
        type=at_least_2,
        metavar="N",
        help="sequence length of the example input for token/feature inputs (default 128, or the spec's "
        "max_len if shorter); the exported model takes any length up to the spec's limit",
    )
    add_quiet(p)
    add_set(p)
    p.set_defaults(func=cmd_export)

    add_import(sub)
    add_serve(sub)

    p = sub.add_parser(
        "eject",
        help="write the model as one standalone PyTorch file",
        description="Write the model's forward, generated from its graph, with every layer it uses, as one "
        "readable .py file that imports only torch: Model() builds it, with the state_dict keys of "
        "specvit's model, so its weights load as they are.",
    )
    p.add_argument("spec", metavar="SPEC", help="spec file (.yaml) or preset name")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="the .py file to write")
    add_set(p)
    p.set_defaults(func=cmd_eject)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    try:
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        return _interrupted("specvit")
    try:
        with named_stdout():
            return int(args.func(args))
    except SpecFileError as exc:
        print(exc, file=sys.stderr)
        return EXIT_IO_ERROR
    except SpecError as exc:
        _say(exc, err=True)
        return EXIT_SPEC_ERROR
    except KeyboardInterrupt:  # Ctrl-C: one line, and the status a shell gives a command ended by SIGINT
        return _interrupted(f"specvit {args.command}")
    except BrokenPipeError:  # output piped into e.g. `head`, which stopped reading
        sys.stderr.close()
        return 0
    except OSError as exc:
        _say(f"specvit {args.command}: {describe(exc)}", err=True)
        return EXIT_IO_ERROR
    except MissingDependencyError as exc:
        _say(f"specvit {args.command}: {exc}", err=True)
        return EXIT_IO_ERROR
    except ModuleNotFoundError as exc:  # a package specvit needs is missing or broken: say which
        _say(
            f"specvit {args.command}: needs the package '{exc.name}', which is not installed ({exc})",
            err=True,
        )
        return EXIT_IO_ERROR
    except CheckpointError as exc:
        _say(f"specvit {args.command}: {exc}", err=True)
        return EXIT_SPEC_ERROR


if __name__ == "__main__":
    sys.exit(main())
