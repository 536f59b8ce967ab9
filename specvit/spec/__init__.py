"""The spec language: schema, loader and cross-field rules."""

from specvit.spec.loader import load_spec, parse_overrides, parse_spec
from specvit.spec.schema import FORMAT_VERSION, Spec, StackSpec

__all__ = ["FORMAT_VERSION", "Spec", "StackSpec", "load_spec", "parse_overrides", "parse_spec"]
