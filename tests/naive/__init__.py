"""Independent naive references for the component tests: loops over Python lists written from
the papers' formulas (never from kvlab's code), and the random contexts they are compared on.

- :mod:`naive.context`: left-padded random :class:`~kvlab.compression.context.LayerContext`
  batches, one sample as lists, building a component, comparing scores with lists.
- :mod:`naive.attention`: list maths (dot, norm, softmax), attention of one query, SnapKV's
  window scores and H2O's accumulated attention with pooling and GQA reduction.
- :mod:`naive.budgets`: the stable top-k rank, SnapKV's kept positions, a two-stage selection,
  PyramidKV's layer totals (KVCache-Factory's and kvpress' formulas).
- :mod:`naive.prefixkv`: PrefixKV's layer importance, global prefix sizes and decode rule.
- :mod:`naive.hybridkv`: HybridKV's text-centric sparsity, top-down budgets, text-prior keep.
- :mod:`naive.retrieval`: chunk retrieval's choice of chunks by mean keys.
- :mod:`naive.quest`: Quest's page bounds from per-channel key minima and maxima, its page choice.
- :mod:`naive.expected_attention`: Expected Attention's query statistics, future rotation and scores.
- :mod:`naive.criticalkv`: CriticalKV's projected value norm and second-stage score.
- :mod:`naive.qfilters`: Q-Filters' first right singular vector (power iteration) and projections.
- :mod:`naive.duo_attention`: DuoAttention's head split on a budget and the needle attention mass.
- :mod:`naive.headkv`: HeadKV's retrieval-reasoning score and head budgets.
- :mod:`naive.vl_cache`: VL-Cache's post-vision scores, layer density and layer budgets.
- :mod:`naive.fastv`: FastV's received attention at layer K - 1 and the tokens kept from layer K on.
"""
