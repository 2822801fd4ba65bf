"""The engine: kvlab's attention function, its schedule, generation, protocols and the engine check.

Importing the package registers every built-in protocol (``query_aware`` in
:mod:`kvlab.engine.protocols`, the context protocols, ``decode_time``).
"""

from kvlab.engine import context_protocols, decode_time  # noqa: F401  (imported for their registrations)
