"""Coverage-guided fuzzing of :func:`specvit.parse_spec` with atheris (libFuzzer for Python).

Every input is given to ``specvit.parse_spec`` as bytes. A :class:`specvit.SpecError` (with at least one
problem, each at a line) is a fine outcome, and so is a valid spec; any other exception is a crash, and an
input that takes longer than ``-timeout`` seconds is a hang. libFuzzer writes the input that caused either
to ``build/fuzz/crash-*`` or ``build/fuzz/timeout-*``; add it to ``tests/robustness_cases.py`` and fix it.

The corpus starts from the bundled presets (``specs/*.yaml``) and ``docs/examples/*.yaml``, copied at every
start into ``build/fuzz/corpus`` (which the run then grows), with a dictionary of YAML tokens and spec keys.

Usage (``make fuzz`` runs it for 60 s; needs ``pip install atheris``)::

    .venv/bin/python tests/fuzz_parse_spec.py -max_total_time=300 [other libFuzzer flags]
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["specvit", "yaml"]):
    import yaml  # noqa: F401  (instrumented: its branches guide the fuzzer)

    import specvit
    import specvit.spec.loader
    import specvit.spec.rules
    from specvit import SpecError

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "fuzz"

# libFuzzer splices these into inputs: YAML syntax, the tags and escapes that matter, and spec keys.
TOKENS = [
    "{", "}", "[", "]", ": ", "- ", ", ", "? ", "&a ", "*a", "<<: ", "'", '"', "\\", "\t", "\n  ", "\n    ",
    "#", "---", "...", "%YAML 1.1", "%TAG ! tag:yaml.org,2002:", "|", ">", "~", "null", "true", ".nan",
    ".inf", "1e-6", "0x1f", "1_000", "1:30", "!!str", "!!int", "!!float", "!!bool", "!!null", "!!map",
    "!!seq", "!!binary", "!!set", "!!python/object/apply:os.system", "\\0", "\\x85", "\\u2028",
    "specvit: 1", "extends", "name", "model", "encoder", "decoder", "encoder_decoder", "head", "input",
    "kind", "image", "tokens", "features", "size", "patch", "channels", "vocab", "prefix", "cls",
    "registers", "position", "learned", "sincos", "rope", "rope2d", "width", "depth", "block", "heads",
    "head_dim", "layers", "self_attention", "masked_self_attention", "cross_attention", "mlp", "norm",
    "layernorm", "rmsnorm", "placement", "pre", "post", "eps", "ratio", "hidden", "activation", "gelu",
    "swiglu", "dropout", "pool", "classes", "classifier", "lm", "tied", "shared_embeddings", "max_len",
]  # fmt: skip


def test_one_input(data: bytes) -> None:
    """One fuzz input: a Spec or a SpecError whose every problem has a line; anything else propagates."""
    try:
        specvit.parse_spec(data)
    except SpecError as exc:
        for problem in exc.problems:
            if problem.location is None or problem.location.line < 1:
                raise AssertionError(f"a problem without a line: {problem}") from None


def _prepare() -> tuple[Path, Path]:
    """A fresh corpus seeded from the presets and examples, and the dictionary file."""
    corpus = WORK / "corpus"
    shutil.rmtree(corpus, ignore_errors=True)
    corpus.mkdir(parents=True)
    seeds = sorted((ROOT / "specs").glob("*.yaml")) + sorted((ROOT / "docs" / "examples").glob("*.yaml"))
    for seed in seeds:
        shutil.copyfile(seed, corpus / seed.name)
    dictionary = WORK / "yaml.dict"
    dictionary.write_text("".join(f'"{_escape(t)}"\n' for t in TOKENS), encoding="utf-8")
    return corpus, dictionary


def _escape(token: str) -> str:
    """A token in libFuzzer's dictionary syntax: printable ASCII, with \\\\, \\" and \\xNN escapes."""
    out = []
    for byte in token.encode("utf-8"):
        char = chr(byte)
        out.append(f"\\{char}" if char in '\\"' else char if 32 <= byte < 127 else f"\\x{byte:02x}")
    return "".join(out)


def main(argv: list[str]) -> None:
    """Run libFuzzer with ``argv``'s flags, adding a time bound, a per-input timeout and the corpus."""
    flags = argv[1:]
    corpus, dictionary = _prepare()
    defaults = {
        "-max_total_time=": "60",  # seconds for the whole run, unless -runs= or -max_total_time= is given
        "-timeout=": "5",  # an input slower than this is reported as a hang (specvit's bound is 1 s)
        "-artifact_prefix=": f"{WORK}/",
        "-dict=": str(dictionary),
        "-print_final_stats=": "1",
    }
    for flag, value in defaults.items():
        bounded = flag == "-max_total_time=" and any(f.startswith("-runs=") for f in flags)
        if not bounded and not any(f.startswith(flag) for f in flags):
            flags.append(flag + value)
    atheris.Setup([argv[0], *flags, str(corpus)], test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
