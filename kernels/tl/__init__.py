"""Triton kernels (``import triton`` happens here, so only when a dispatcher picks Triton).

One module per kernel, each holding the ``@triton.jit`` functions and a launcher with the
same signature as the torch reference in the matching :mod:`kvlab.kernels` module. They are
separate modules because triton stays an optional dependency (the references need torch only)
and ``@triton.jit`` functions cannot be defined lazily inside a factory (they must be module
level to call each other).
"""
