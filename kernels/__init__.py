"""kvlab's kernels, installed as ``kvlab.kernels``: decode attention, window scores, compaction,
merge and chunk retrieval (``docs/kernels.md``).

Each module holds a torch reference that runs anywhere and a dispatcher with the same signature
(:mod:`kvlab.kernels.dispatch`) that runs the Triton kernel of :mod:`kvlab.kernels.tl` instead on
CUDA tensors. The package sits just above the ground: it imports only :mod:`kvlab.config` and
itself.
"""
