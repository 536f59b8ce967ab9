"""Subcommands kept beside :mod:`specvit.cli`: ``presets`` (the bundled presets with their sizes) and
``import`` (the spec of another library's model, as a readable file)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from specvit.arguments import port

__all__ = ["add_import", "add_serve", "cmd_import", "cmd_presets", "cmd_serve"]

EXIT_IO_ERROR = 1


def cmd_import(args: argparse.Namespace) -> int:
    """Write the spec of the config ``args.config`` (a config.json, or a model directory holding one) to
    ``args.output``; nothing is written if it is refused."""
    from specvit.interop.hf import spec_dict
    from specvit.io import atomic_write
    from specvit.spec.loader import parse_spec
    from specvit.spec.yamlread import dump_yaml

    config, shown = args.config, os.path.basename(args.config)
    if os.path.isdir(config):  # a model directory (save_pretrained's, a Hub snapshot): its config.json
        config = os.path.join(config, "config.json")
        shown = os.path.join(os.path.basename(os.path.normpath(args.config)), "config.json")
    if os.path.exists(args.output) and os.path.exists(config) and os.path.samefile(args.output, config):
        print(f"specvit import: -o {args.output} is the config itself; name another file", file=sys.stderr)
        return EXIT_IO_ERROR
    data = spec_dict(config)
    if args.name:
        data["name"] = args.name
    data["description"] += f" Source: {shown}."
    parse_spec(data, source=args.output)  # what is written is a valid spec
    atomic_write(args.output, dump_yaml(data))
    print(f"wrote {args.output} ({data['name']}: {data['model']})")
    return 0


def add_import(sub: Any) -> None:
    """Add the ``import`` subcommand to the CLI's subparsers."""
    p = sub.add_parser(
        "import",
        help="write the spec of a model from another library's config (HF transformers)",
        description="Read a transformers config.json (or the model directory holding it) and write the spec "
        "of exactly that architecture as a readable YAML file (defaults left out). Architectures specvit "
        "cannot state exactly are refused, naming the config field. specvit.from_pretrained(DIR) loads the "
        "model with its weights.",
    )
    p.add_argument("source", choices=["hf"], help="the library the config comes from")
    p.add_argument("config", metavar="CONFIG", help="the config.json, or a model directory holding it")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="the .yaml spec to write")
    p.add_argument("--name", help="the spec's name (default: <model_type>_from_hf)")
    p.set_defaults(func=cmd_import)


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the live editor's server on ``args.spec`` (a file, a folder or the working directory) until Ctrl-C."""
    from specvit.serve import ServeError, serve

    try:
        serve(args.spec, host=args.host, port=args.port)
    except ServeError as exc:
        print(f"specvit serve: {exc}", file=sys.stderr)
        return EXIT_IO_ERROR
    except KeyboardInterrupt:  # how the server is stopped: not an error
        print("specvit serve: stopped", file=sys.stderr)
    return 0


def add_serve(sub: Any) -> None:
    """Add the ``serve`` subcommand (the live editor in the browser) to the CLI's subparsers."""
    p = sub.add_parser(
        "serve",
        help="edit a spec in the browser: errors at their line, diagram and table as you type",
        description="Start a local web server and print its address: the page edits the spec (or the specs "
        "of a folder) with the problems marked at their lines as you type, the interactive diagram and the "
        "summary table beside it, saving atomically (never over a file changed on disk since it was "
        "loaded), downloads of the diagram (SVG, PNG, HTML) and of the ejected PyTorch file, and a diff with "
        "another spec or preset. It listens on 127.0.0.1 only unless --host says otherwise, and serves only "
        "its own files and the spec files under the folder. Ctrl-C stops it.",
    )
    p.add_argument(
        "spec",
        metavar="SPEC",
        nargs="?",
        help="a spec file (.yaml; a new one is created on save) or a folder of specs (default: the "
        "working directory)",
    )
    p.add_argument(
        "--port", type=port, default=8765, metavar="N", help="the port (default 8765; 0: any free one)"
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        metavar="ADDR",
        help="the address to listen on (default 127.0.0.1: this machine only; another address lets other "
        "machines read and overwrite the specs, and prints a warning)",
    )
    p.set_defaults(func=cmd_serve)


def cmd_presets(args: argparse.Namespace) -> int:
    """List the bundled presets: name, model kind, parameters, FLOPs (or MACs with ``--macs``) and the useful
    part, the sizes they were counted at (``specvit summary``'s defaults) and description (or JSON)."""
    from specvit.graph import build_graph
    from specvit.spec import load_spec
    from specvit.spec.presets import preset_dir, preset_names
    from specvit.units import flop_unit, format_count, format_params, format_sizes

    unit = flop_unit(args.macs)
    rows: list[dict[str, Any]] = []
    names = preset_names()
    for name in names:
        spec = load_spec(name)
        graph = build_graph(spec)
        rows.append(
            {
                "name": name,
                "model": spec.model,
                "params": graph.total_params,
                unit.key: unit.of(graph.total_flops),
                f"useful_{unit.key}": unit.of(graph.total_useful_flops),
                "dims": graph.dims,
                "description": spec.description,
            }
        )
    folder = preset_dir()
    if args.json:
        print(
            json.dumps(
                {"folder": str(folder) if folder else None, "unit": unit.meaning, "presets": rows}, indent=2
            )
        )
        return 0
    if not rows:
        print(
            "specvit presets: no bundled presets found (this installation lacks specvit/presets)",
            file=sys.stderr,
        )
        return EXIT_IO_ERROR
    useful = f"useful {unit.name}"
    table = [("name", "model", "params", unit.name, useful, "at", "description")]
    for r in rows:
        counts = (format_count(r[unit.key]), format_count(r[f"useful_{unit.key}"]))
        table.append(
            (
                r["name"],
                r["model"],
                format_params(r["params"]),
                *counts,
                format_sizes(r["dims"]),
                r["description"],
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    for row in table:
        cells = [
            c.rjust(w) if 2 <= i <= 4 else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=False))
        ]
        print("  ".join([*cells, row[-1]]))
    example = "vit_base_patch16_224" if "vit_base_patch16_224" in names else rows[0]["name"]
    print(
        f"\n{unit.meaning} of one forward at the sizes under 'at'; {useful} leave out the query-key pairs a "
        f"causal mask or a sliding window hides.\n{len(rows)} presets in {folder}; give a name where a spec "
        f"file goes: specvit summary {example}"
    )
    return 0
