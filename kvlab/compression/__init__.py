"""Compression components. Importing the package registers every component module's components."""

from kvlab.compression import (  # noqa: F401  (imported for their registrations)
    allocators,
    criticalkv,
    decode,
    decode_prefixkv,
    diversity,
    expected_attention,
    fastv,
    hybridkv,
    importance,
    merge,
    mixers,
    modality,
    prefixkv,
    retrieval,
    routing,
    selectors,
    two_stage,
)
