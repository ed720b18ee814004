"""Resolving and loading a model and building its states: where a --model spec resolves (a
folder, a GGUF, an embedded PyPI model, a hub cache), its identity and digests,
precision names, loading transformers quietly, the boundary state and its constructions,
decoding from it, and cut-and-refeed items made from its generations."""
