"""The storage layer: the ragged compressed cache and what a run's components share.

Below the components (:mod:`kvlab.compression`) and above the models: ``selection`` (what a
layer keeps), ``layer`` (one layer's ragged storage and decode attention), ``slots`` (the slot
layout decode policies address), ``checkpoint``, ``accounting`` (bytes), ``cache`` (the
transformers ``Cache`` over the layers). See docs/architecture.md, "The cache".
"""
