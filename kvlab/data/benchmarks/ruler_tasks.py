"""RULER's task table and templates, as NVIDIA/RULER states them (``scripts/synthetic.yaml``,
``scripts/data/synthetic/constants.py``): what :mod:`kvlab.data.benchmarks.ruler` generates."""

from __future__ import annotations

from typing import Any

__all__ = ["DEPTHS", "NEEDLE", "NOISE", "REFUSED", "RULER_TASKS", "TEMPLATES", "VT_EXAMPLE_TOKENS"]

#: RULER ``constants.py``: per task family, the output length, the template and the answer prefix
TEMPLATES: dict[str, dict[str, Any]] = {
    "niah": {
        "tokens_to_generate": 128,
        "template": (
            "Some special magic {type_needle_v} are hidden within the following text. Make sure to "
            "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all "
            "the special magic {type_needle_v} for {query} mentioned in the provided text?"
        ),
        "answer_prefix": " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    },
    "variable_tracking": {
        "tokens_to_generate": 30,
        "template": (
            "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
            "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above."
        ),
        "answer_prefix": (
            " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
            "variables are assigned the value {query}, they are: "
        ),
    },
    "common_words_extraction": {
        "tokens_to_generate": 120,
        "template": (
            "Below is a numbered list of words. In these words, some appear more often than others. "
            "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common "
            "words in the above list?"
        ),
        "answer_prefix": " Answer: The top 10 words that appear most often in the list are:",
    },
    "freq_words_extraction": {
        "tokens_to_generate": 50,
        "template": (
            "Read the following coded text and track the frequency of each coded word. Find the three "
            "most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. "
            "Please ignore the dots '....'. What are the three most frequently appeared words in the "
            "above coded text?"
        ),
        "answer_prefix": (
            " Answer: According to the coded text above, the three most frequently appeared words are:"
        ),
    },
}


def _niah(
    haystack: str, key: str, value: str, k: int = 1, v: int = 1, q: int = 1
) -> tuple[str, dict[str, Any]]:
    params = {"type_haystack": haystack, "type_needle_k": key, "type_needle_v": value}
    return "niah", {**params, "num_needle_k": k, "num_needle_v": v, "num_needle_q": q}


#: RULER ``synthetic.yaml``: task -> (family, arguments)
RULER_TASKS: dict[str, tuple[str, dict[str, Any]]] = {
    "niah_single_1": _niah("noise", "words", "numbers"),
    "niah_single_2": _niah("essay", "words", "numbers"),
    "niah_single_3": _niah("essay", "words", "uuids"),
    "niah_multikey_1": _niah("essay", "words", "numbers", k=4),
    "niah_multikey_2": _niah("needle", "words", "numbers"),
    "niah_multikey_3": _niah("needle", "uuids", "uuids"),
    "niah_multivalue": _niah("essay", "words", "numbers", v=4),
    "niah_multiquery": _niah("essay", "words", "numbers", q=4),
    "vt": ("variable_tracking", {"type_haystack": "noise", "num_chains": 1, "num_hops": 4}),
    "cwe": ("common_words_extraction", {"freq_cw": 30, "freq_ucw": 3, "num_cw": 10}),
    "fwe": ("freq_words_extraction", {"alpha": 2.0}),
}
REFUSED = {
    name: f"it asks questions about {source} documents, which kvlab cannot download; run the "
    "synthetic tasks, or LongBench's hotpotqa through the `longbench` dataset"
    for name, source in (("qa_1", "SQuAD"), ("qa_2", "HotpotQA"))
}
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
#: RULER's needle depths (percent): ``np.round(np.linspace(0, 100, num=40)).astype(int)``
DEPTHS = [round(100 * i / 39) for i in range(40)]
#: RULER's ICL example budget for variable tracking (``max_seq_length=500``)
VT_EXAMPLE_TOKENS = 500
