"""Other libraries' models as specvit specs and weights: :func:`specvit.interop.hf.from_hf` reads a
transformers config; each ``hf_*`` module is one family (its config mapping and weight layout)."""
