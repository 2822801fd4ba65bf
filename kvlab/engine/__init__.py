"""The engine: kvlab's attention function, the ragged compressed cache and the prefill/decode steps."""
