"""Every op kind, defined once: spec fragments, graph node kinds and block sublayers.

Importing this package imports every module in it, and so registers every definition; the schema, the
lowering, the compiler, the init, the diagrams and the docs read the registries (:data:`OPS`,
:data:`SUBLAYERS`, :func:`fragments`). A new op is one new module here. See ``docs/architecture.md``.
"""

import importlib
import pkgutil

from specvit.ops.base import OPS, Fragment, Op, Params, fragment, fragments, op
from specvit.ops.block import SUBLAYERS, BlockCtx, Sublayer, sublayer

__all__ = [
    "OPS",
    "SUBLAYERS",
    "BlockCtx",
    "Fragment",
    "Op",
    "Params",
    "Sublayer",
    "fragment",
    "fragments",
    "op",
    "sublayer",
]

for _module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    importlib.import_module(f"{__name__}.{_module.name}")
