"""The papers kvlab's components follow, cited once (a component's ``paper`` class attribute).

``kvlab list --format markdown`` and the documentation site's component reference print them
beside each component; ``docs/methods/`` says where kvlab's reading differs from a paper.
"""

SNAPKV = 'Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation"'
H2O = (
    'Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of '
    'Large Language Models"'
)
STREAMINGLLM = 'Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks"'
KNORM = 'Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression"'
VNORM = (
    'Guo et al. 2024, "Attention Score is not All You Need for Token Importance Indicator in KV Cache '
    'Reduction: Value Also Matters"'
)
KEYDIFF = (
    'Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference '
    'in Resource-Constrained Environments"'
)
PYRAMIDKV = (
    'Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling"'
)
ADAKV = (
    'Feng et al. 2025, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget '
    'Allocation for Efficient LLM Inference"'
)
SPARSEMM = 'Wang et al. 2025, "SparseMM: Head Sparsity Emerges from Visual Concept Responses in MLLMs"'
MIXKV = (
    'Liu et al. 2025, "Mixing Importance with Diversity: Joint Optimization for KV Cache Compression in '
    'Large Vision-Language Models"'
)
LOOKM = (
    'Wan et al. 2024, "LOOK-M: Look-Once Optimization in KV Cache for Efficient '
    'Multimodal Long-Context Inference"'
)
DAVID = (
    'Gu et al. 2026, "DAVID: Dual-Stage Adaptive Vision-Text Integrated Decoupling for Multimodal KV Cache '
    'Eviction"'
)
HYBRIDKV = (
    'Zeng et al. 2026, "HybridKV: Hybrid KV Cache Compression for Efficient Multimodal '
    'Large Language Model Inference"'
)
PREFIXKV = (
    'Wang et al. 2024, "PrefixKV: Adaptive Prefix KV Cache is What Vision Instruction-Following Models '
    'Need for Efficient Generation"'
)
EXPECTED_ATTENTION = (
    'Devoto et al. 2025, "Expected Attention: KV Cache Compression by Estimating Attention from Future '
    'Queries Distribution"'
)
TOVA = 'Oren et al. 2024, "Transformers are Multi-State RNNs" (TOVA, arXiv 2401.06104)'
RKV = (
    'Cai et al. 2025, "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models" '
    "(R-KV, arXiv 2505.24133)"
)
LAGKV = (
    'Liang et al. 2025, "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are Important"'
)
CURDKV = 'Sengupta et al. 2025, "Value-Guided KV Compression for LLMs via Approximated CUR Decomposition"'
DMS = 'Łańcucki et al. 2025, "Inference-Time Hyper-Scaling with KV Cache Compression" (DMS, arXiv 2506.05345)'
COMPACTOR = (
    'Chari & Van Durme 2025, "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate '
    'Leverage Scores" (arXiv 2507.08143)'
)
CHUNKKV = (
    'Liu et al. 2025, "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM '
    'Inference"'
)
CRITICALKV = (
    'Feng et al. 2025, "Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective"'
)
FASTV = (
    'Chen et al. 2024, "An Image is Worth 1/2 Tokens After Layer 2: Plug-and-Play Inference Acceleration '
    'for Large Vision-Language Models"'
)
QFILTERS = 'Godey et al. 2025, "Q-Filters: Leveraging QK Geometry for Efficient KV Cache Compression"'
DUOATTENTION = (
    'Xiao et al. 2024, "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming '
    'Heads"'
)
HEADKV = (
    'Fu et al. 2024, "Not All Heads Matter: A Head-Level KV Cache Compression Method with Integrated '
    'Retrieval and Reasoning"'
)
VLCACHE = (
    'Tu et al. 2024, "VL-Cache: Sparsity and Modality-Aware KV Cache Compression for Vision-Language Model '
    'Inference Acceleration"'
)
KIVI = 'Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"'
TURBOQUANT = (
    'Zandieh et al. 2025, "TurboQuant: Online Vector Quantization with Near-optimal Distortion Rate" '
    "(arXiv 2504.19874)"
)
SIMLAYERKV = (
    'Zhang et al. 2024, "SimLayerKV: A Simple Framework for Layer-Level KV Cache Reduction" '
    "(SimLayerKV, arXiv 2410.13846)"
)
QUEST = (
    'Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference" '
    "(ICML 2024, arXiv 2406.10774)"
)
FINCH = (
    'Corallo and Papotti 2024, "FINCH: Prompt-guided Key-Value Cache Compression for Large Language '
    'Models" (TACL 2024, arXiv 2408.00167)'
)
THINK = 'Xu et al. 2024, "ThinK: Thinner Key Cache by Query-Driven Pruning" (ICLR 2025, arXiv 2407.21018)'
KVZIP = (
    'Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction" '
    "(arXiv 2505.23416)"
)
CAPKV = (
    'Tang et al. 2026, "Rethinking KV Cache Eviction via a Unified Information-Theoretic Objective" '
    "(CapKV, arXiv 2604.25975)"
)
