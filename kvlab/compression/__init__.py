"""Compression components. Importing the package registers every component module's components."""

from kvlab.compression import (  # noqa: F401  (imported for their registrations)
    allocators,
    decode,
    decode_prefixkv,
    diversity,
    expected_attention,
    hybridkv,
    importance,
    merge,
    mixers,
    modality,
    prefixkv,
    quantizers,
    retrieval,
    routing,
    selectors,
)
