"""String and sequence similarity used by the task and fidelity metrics.

- :func:`normalize_answer`: SQuAD normalisation (lower case, no punctuation, no articles,
  collapsed whitespace); :func:`words` splits the normalised text.
- :func:`lcs_length`: longest common subsequence of two sequences (dynamic programming,
  ``O(len(a) * len(b))`` time, ``O(len(b))`` memory).
- :func:`rouge_l`: ROUGE-L F1 = ``2 P R / (P + R)`` with ``P = LCS / len(pred)`` and
  ``R = LCS / len(ref)`` (Lin 2004, beta = 1); two empty sequences score 1.
- :func:`token_f1`: SQuAD token F1 over the multiset of shared words; two empty answers score 1.
- :func:`counter_f1`, :func:`qa_f1_score`: LongBench's and InfiniteBench's variant of the same
  F1 (two empty sequences score 0); :func:`normalize_zh_answer`: their normalisation of Chinese
  text (no Chinese or ASCII punctuation, no whitespace); :func:`chinese_words`: jieba's word
  segmentation (an optional dependency, ``pip install 'kvlab[zh]'``); :func:`has_chinese`.

All work on any sequence of hashables: words for task metrics, token ids for fidelity.
"""

from __future__ import annotations

import logging
import re
import string
from collections import Counter
from collections.abc import Hashable, Sequence

from kvlab.config.errors import ConfigError

_PUNCTUATION = set(string.punctuation)

_ZH_PUNCTUATION = (  # LongBench's and InfiniteBench's list, full-width characters included
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠"
    "｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_ALL_PUNCTUATION = set(string.punctuation + _ZH_PUNCTUATION)


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and articles, collapse whitespace (SQuAD normalisation)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def words(text: str) -> list[str]:
    """The words of the normalised text."""
    return normalize_answer(text).split()


def lcs_length(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """Length of the longest common subsequence of ``a`` and ``b``."""
    if len(a) < len(b):
        a, b = b, a
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def _f1(overlap: int, n_pred: int, n_ref: int) -> float:
    if n_pred == 0 and n_ref == 0:
        return 1.0
    if overlap == 0:
        return 0.0
    precision, recall = overlap / n_pred, overlap / n_ref
    return 2 * precision * recall / (precision + recall)


def rouge_l(pred: Sequence[Hashable], ref: Sequence[Hashable]) -> float:
    """ROUGE-L F1 of two sequences (see the module docstring)."""
    return _f1(lcs_length(pred, ref), len(pred), len(ref))


def token_f1(pred: Sequence[Hashable], ref: Sequence[Hashable]) -> float:
    """SQuAD token F1: overlap of the two multisets of tokens."""
    overlap = sum((Counter(pred) & Counter(ref)).values())
    return _f1(overlap, len(pred), len(ref))


def position_match(pred: Sequence[Hashable], ref: Sequence[Hashable]) -> float:
    """Fraction of positions holding the same token: ``#{i: pred[i] == ref[i]} / max(len)``.

    Two empty sequences score 1.
    """
    longest = max(len(pred), len(ref))
    if longest == 0:
        return 1.0
    return sum(x == y for x, y in zip(pred, ref, strict=False)) / longest


def counter_f1(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    """LongBench's ``f1_score``: F1 of the shared multiset of tokens, 0 when nothing is shared
    (two empty sequences also score 0, unlike SQuAD's convention)."""
    num_same = sum((Counter(prediction) & Counter(ground_truth)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction)
    recall = num_same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str) -> float:
    """LongBench/InfiniteBench ``qa_f1_score``: :func:`counter_f1` of the SQuAD-normalised words."""
    return counter_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def normalize_zh_answer(text: str) -> str:
    """InfiniteBench ``normalize_zh_answer``: lower case, no (Chinese or ASCII) punctuation, no spaces."""
    return "".join("".join(ch for ch in text.lower() if ch not in _ALL_PUNCTUATION).split())


#: how to install jieba, the Chinese word segmenter LongBench's Chinese metrics need
JIEBA_INSTALL = "pip install 'kvlab[zh]' (or pip install jieba==0.42.1, the version LongBench uses)"
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")


def has_chinese(text: str) -> bool:
    """Whether ``text`` holds a CJK ideograph (a Chinese answer)."""
    return _CJK.search(text) is not None


def jieba_available() -> bool:
    """Whether jieba can be imported (checked before a run that needs it loads a model)."""
    try:
        import jieba  # noqa: F401  (optional dependency, the zh extra: is it installed?)
    except ImportError:
        return False
    return True


def chinese_words(text: str) -> list[str]:
    """``list(jieba.cut(text, cut_all=False))``: jieba's accurate mode, as LongBench's metrics.

    Raises:
        ConfigError: jieba is not installed (never a whitespace fallback: it scores otherwise).
    """
    try:
        import jieba  # optional dependency (the zh extra): Chinese word segmentation
    except ImportError:
        raise ConfigError(f"scoring Chinese LongBench answers needs jieba: {JIEBA_INSTALL}.") from None
    jieba.setLogLevel(logging.WARNING)  # not the dictionary-loading messages on every run
    return list(jieba.cut(text, cut_all=False))
