"""Offline model scaffolding for the built-in models: SmolLM2's GGUF conversion, the grafted VLMs,
the runtime-trained tokenizer and the tiny random configs. Users' own models never go through here."""
