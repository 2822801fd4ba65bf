"""``ruler``: RULER's synthetic tasks, generated offline at lengths measured with the run's tokenizer.

RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?", Sec. 3) builds each prompt to a target sequence length; this module reproduces its
generators (NVIDIA/RULER ``scripts/data/synthetic/{niah,variable_tracking,
common_words_extraction,freq_words_extraction}.py``), task settings (``scripts/synthetic.yaml``),
templates, answer prefixes and output lengths (``scripts/data/synthetic/constants.py``; both in
:mod:`kvlab.data.benchmarks.ruler_tasks`):

==================  ==============================================================  ======
task                what                                                            tokens
==================  ==============================================================  ======
niah_single_1/2/3   one needle "One of the special magic numbers for <key> is: <v>."    128
                    in repeated noise / essay text; values: 7-digit numbers or uuids
niah_multikey_1/2/3 the needle among distractor needles (essay / needle haystacks)     128
niah_multivalue     four values for one key, all asked                                 128
niah_multiquery     four keys asked at once                                            128
vt                  variable tracking: a chain VAR A = 12345, VAR B = VAR A, ... in      30
                    noise, after one worked example; name every variable of the value
cwe                 common words: the 10 words repeated most in a numbered list,        120
                    after one worked example
fwe                 frequent words: the 3 most frequent coded words of a Zipf text       50
==================  ==============================================================  ======

Length: RULER's ``max_seq_length`` counts the prompt and the tokens to generate; kvlab fits the
number of haystack units (words, noise sentences, distractor needles, list words, coded words)
so that the prompt as the run's model sees it (chat template included, answer prefix included,
:mod:`kvlab.data.tokens`) plus the task's output length is at most ``length``, and
adding one unit would exceed it. ``Sample.meta["prompt_tokens"]`` records the measured prompt.

Differences from RULER, all forced by working offline (docs/benchmark_suites.md): the "essay"
haystack is kvlab's generated filler prose unless ``haystack_path`` points at RULER's
``PaulGrahamEssays.json`` (or any text); keys and common words come from
:mod:`kvlab.data.benchmarks.words` instead of ``wonderwords``; sentences are split by
punctuation instead of NLTK; distractor needles never reuse a queried key; randomness comes from
one ``random.Random`` per sample (``f"{seed}:{task}:{length}:{index}"``). The QA tasks (qa_1,
qa_2) need SQuAD and HotpotQA and are refused.
"""

from __future__ import annotations

import math
import random
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvlab.config.errors import ConfigError
from kvlab.config.registry import context_field
from kvlab.data.benchmarks.common import HaystackWords, check_count, check_tasks, split_sentences
from kvlab.data.benchmarks.ruler_tasks import (
    DEPTHS,
    NEEDLE,
    NOISE,
    REFUSED,
    RULER_TASKS,
    TEMPLATES,
    VT_EXAMPLE_TOKENS,
)
from kvlab.data.benchmarks.words import key_words, word_pool
from kvlab.data.datasets import DATASETS, check_metrics
from kvlab.data.sample import Sample
from kvlab.data.tokens import ProcessorSource, check_tokenizer_name, fit_units, require_tokenizer

__all__ = ["RulerDataset"]


def zeta(alpha: float) -> float:
    """The Riemann zeta function for ``alpha > 1`` (``scipy.special.zeta`` in RULER): the partial
    sum to 1000 plus the Euler-Maclaurin tail (error below 1e-12 for ``alpha >= 1.1``)."""
    n = 1000
    head = math.fsum(k**-alpha for k in range(1, n))
    tail = n ** (1 - alpha) / (alpha - 1) + 0.5 * n**-alpha + alpha * n ** (-alpha - 1) / 12
    return head + tail


@dataclass
class _Draft:
    """One prompt before it is measured: the filled template split as a sample needs it."""

    before: str  # text before the context (few-shot examples, instruction)
    context: str
    after: str  # the question (after the context)
    answer_prefix: str
    answers: list[str]
    meta: dict[str, Any]

    def sample(self, sample_id: str, max_new_tokens: int) -> Sample:
        return Sample(
            id=sample_id,
            prompt=self.before + self.context + self.after,
            question=self.after,
            answer_prefix=self.answer_prefix,
            answers=self.answers,
            max_new_tokens=max_new_tokens,
            meta=self.meta,
        )


def _split_template(template: str, answer_prefix: str, **fields: Any) -> tuple[str, str, str]:
    before, _, after = template.partition("{context}")
    return before.format(**fields), after.format(**fields), answer_prefix.format(**fields)


@DATASETS.register("ruler")
@dataclass
class RulerDataset:
    """RULER's synthetic long-context tasks at lengths measured with the run's tokenizer.

    ``tasks`` (default: all 11 synthetic tasks) x ``lengths`` (tokens: prompt, chat template
    and output length together) x ``samples_per_task`` samples, in that order. ``haystack_path``
    replaces the generated essay filler by a text (RULER's ``PaulGrahamEssays.json``, a .txt
    file or a directory of them). ``tokenizer``: the model whose tokenizer measures the lengths
    (null: the run's ``model.model``). Scored by RULER's ``string_match_all``.
    """

    tasks: list[str] = field(default_factory=lambda: list(RULER_TASKS))
    lengths: list[int] = field(default_factory=lambda: [4096])
    samples_per_task: int = 8
    seed: int = 0
    haystack_path: str | None = None
    tokenizer: str | None = None
    processors: ProcessorSource | None = context_field()  # loads the tokenizer's processor (kvlab's)
    metrics: tuple[str, ...] = ("string_match_all",)

    def __post_init__(self) -> None:
        self.tasks = list(check_tasks(self.tasks, RULER_TASKS, "RULER", REFUSED))
        if (
            isinstance(self.lengths, int | str)
            or not self.lengths
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 256 for n in self.lengths)
        ):
            raise ConfigError(
                "data.dataset.lengths must be a non-empty list of token counts >= 256, got "
                f"{self.lengths!r}. RULER's standard lengths are [4096, 8192, 16384, 32768, 65536, 131072]."
            )
        self.lengths = list(self.lengths)
        check_count(self.samples_per_task, "samples_per_task")
        check_count(self.seed, "seed", least=0)
        check_tokenizer_name(self.tokenizer, self.processors)
        self.metrics = check_metrics(self.metrics)
        self._haystack = HaystackWords(self.haystack_path, self.seed)
        self._keys = key_words()
        self._vt_example: dict[str, str] = {}

    # ---- public -----------------------------------------------------------------------------
    def samples(self) -> list[Sample]:
        """Every (task, length, index) sample, measured and fitted with the tokenizer."""
        counter = require_tokenizer(self.tokenizer, self.processors, "ruler", "lengths")
        out = []
        for task in self.tasks:
            for length in self.lengths:
                out.extend(self._task_samples(counter, task, length))
        return out

    def prompt(self, task: str, length: int, index: int, units: int) -> Sample:
        """Sample ``index`` of ``task`` at ``length`` built with ``units`` haystack units (what
        :meth:`samples` fits; for inspecting the fit)."""
        counter = require_tokenizer(self.tokenizer, self.processors, "ruler", "lengths")
        family, params = RULER_TASKS[task]
        generate = self._generator(counter, family, params, length)
        draft = generate(random.Random(f"{self.seed}:{task}:{length}:{index}"), units)
        return draft.sample(f"ruler-{task}-{length}-{index:04d}", TEMPLATES[family]["tokens_to_generate"])

    # ---- fitting ----------------------------------------------------------------------------
    def _task_samples(self, counter: Any, task: str, length: int) -> list[Sample]:
        family, params = RULER_TASKS[task]
        max_new = TEMPLATES[family]["tokens_to_generate"]
        limit = length - max_new
        lowest = self._lowest(family, params)
        out, start = [], max(lowest, 16)
        for index in range(self.samples_per_task):

            def build(n: int, index: int = index) -> Sample:
                return self.prompt(task, length, index, n)

            fitted = fit_units(lambda n, build=build: counter.count_prompt(build(n)), limit, start, lowest)
            if fitted is None:
                shortest = counter.count_prompt(build(lowest))
                raise ConfigError(
                    f"data.dataset.lengths: {length} tokens is too short for RULER task '{task}' with "
                    f"tokenizer {counter.name}: its shortest prompt takes {shortest} tokens and the task "
                    f"generates up to {max_new}. Use lengths >= {shortest + max_new}."
                )
            n, prompt_tokens = fitted
            start = n
            sample = build(n)
            sample.meta.update(
                suite="ruler", task=task, length=length, prompt_tokens=prompt_tokens, haystack_units=n
            )
            out.append(sample)
        return out

    @staticmethod
    def _lowest(family: str, params: dict[str, Any]) -> int:
        """The fewest haystack units a generator accepts."""
        if family == "niah":
            return max(params["num_needle_k"], params["num_needle_q"]) * params["num_needle_v"]
        if family == "common_words_extraction":
            return params["num_cw"] + 1
        if family == "variable_tracking":
            return params["num_chains"] * (params["num_hops"] + 1)
        return 1

    def _generator(
        self, counter: Any, family: str, params: dict[str, Any], length: int
    ) -> Callable[[random.Random, int], _Draft]:
        if family == "niah":
            return lambda rng, n: self._niah(rng, n, **params)
        if family == "variable_tracking":
            example = self._vt_icl(counter, params)
            return lambda rng, n: self._variable_tracking(rng, n, example, **params)
        if family == "common_words_extraction":
            return lambda rng, n: self._common_words(rng, n, length, **params)
        vocab_size = (length - TEMPLATES[family]["tokens_to_generate"]) // 50
        return lambda rng, n: self._freq_words(rng, n, vocab_size, **params)

    # ---- niah (RULER niah.py) ---------------------------------------------------------------
    def _random_value(self, rng: random.Random, kind: str) -> str:
        if kind == "numbers":
            return str(rng.randint(10**6, 10**7 - 1))
        if kind == "words":
            return rng.choice(self._keys)
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))

    def _niah(
        self,
        rng: random.Random,
        n: int,
        type_haystack: str,
        type_needle_k: str,
        type_needle_v: str,
        num_needle_k: int,
        num_needle_v: int,
        num_needle_q: int,
    ) -> _Draft:
        num_needle_k = max(num_needle_k, num_needle_q)  # as RULER's argument parsing does
        keys, values, needles = [], [], []
        for _ in range(num_needle_k):
            keys.append(self._random_value(rng, type_needle_k))
            value = []
            for _ in range(num_needle_v):
                value.append(self._random_value(rng, type_needle_v))
                needles.append(NEEDLE.format(type_needle_v=type_needle_v, key=keys[-1], value=value[-1]))
            values.append(value)
        random.Random(self.seed).shuffle(needles)  # RULER shuffles with its fixed seed
        if type_haystack == "essay":
            sentences = split_sentences(" ".join(self._haystack.take(n)))
            depths = rng.sample(DEPTHS, len(needles))
            cuts = [0, *sorted(int(len(sentences) * (d / 100)) for d in depths), len(sentences)]
            parts = []
            for i in range(1, len(cuts)):
                parts.append(" ".join(sentences[cuts[i - 1] : cuts[i]]))
                if i - 1 < len(needles):
                    parts.append(needles[i - 1])
            context = " ".join(parts)
            depth_percent = sorted(depths)
        else:
            if type_haystack == "noise":
                lines = [NOISE] * n
            else:  # distractor needles; never a key of the needles (kvlab: an ambiguous question otherwise)
                lines = []
                while len(lines) < n:
                    key = self._random_value(rng, type_needle_k)
                    if key not in keys:
                        value = self._random_value(rng, type_needle_v)
                        lines.append(NEEDLE.format(type_needle_v=type_needle_v, key=key, value=value))
            indexes = sorted(rng.sample(range(n), len(needles)), reverse=True)
            for index, needle in zip(indexes, needles, strict=True):
                lines.insert(index, needle)
            context = "\n".join(lines)
            depth_percent = sorted(round(100 * i / n, 2) for i in indexes)
        queried = rng.sample(range(num_needle_k), num_needle_q)
        queries = [keys[i] for i in queried]
        answers = [a for i in queried for a in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        template, prefix, noun = (
            TEMPLATES["niah"]["template"],
            TEMPLATES["niah"]["answer_prefix"],
            type_needle_v,
        )
        if num_needle_q * num_needle_v == 1:  # RULER's singular wording
            template, prefix = (self._singular(t) for t in (template, prefix))
            noun = noun[:-1]
        before, after, answer_prefix = _split_template(template, prefix, type_needle_v=noun, query=query)
        meta = {"needle_depths": depth_percent, "keys": queries}
        return _Draft(before, context, after, answer_prefix, answers, meta)

    @staticmethod
    def _singular(text: str) -> str:
        """RULER's rewording for one needle and one value (its ``str.replace`` chain, in order)."""
        for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            text = text.replace(old, new)
        return text

    # ---- variable tracking (RULER variable_tracking.py) ---------------------------------------
    @staticmethod
    def _chains(
        rng: random.Random, num_chains: int, num_hops: int, icl: bool
    ) -> tuple[list[list[str]], list[list[str]]]:
        k = 3 if icl else 5
        hops = min(10, num_hops) if icl else num_hops
        names = ["".join(rng.choices(string.ascii_uppercase, k=k)) for _ in range((hops + 1) * num_chains)]
        while len(set(names)) < num_chains * (hops + 1):
            names.append("".join(rng.choices(string.ascii_uppercase, k=k)))
        variables, chains = [], []
        for i in range(0, len(names), hops + 1):
            these = names[i : i + hops + 1]
            variables.append(these)
            start = "12345" if icl else str(rng.randint(10000, 99998))  # np.random.randint(10000, 99999)
            chain = [f"VAR {these[0]} = {start}"]
            chain.extend(f"VAR {these[j + 1]} = VAR {these[j]} " for j in range(hops))
            chains.append(chain)
        return variables, chains

    def _vt_text(
        self, rng: random.Random, n: int, num_chains: int, num_hops: int, icl: bool
    ) -> tuple[str, str, str, list[str], str, str]:
        """``(before, context, after, variables, answer_prefix, value)`` of one variable-tracking prompt."""
        variables, chains = self._chains(rng, num_chains, num_hops, icl)
        value = chains[0][0].split("=")[-1].strip()
        lines = [NOISE] * n
        for chain in chains:
            positions = sorted(rng.sample(range(len(lines)), len(chain)))
            for offset, (position, line) in enumerate(zip(positions, chain, strict=True)):
                lines.insert(position + offset, line)
        context = "\n".join(lines).replace(". \n", ".\n")
        family = TEMPLATES["variable_tracking"]
        hops = min(10, num_hops) if icl else num_hops
        before, after, prefix = _split_template(
            family["template"], family["answer_prefix"], query=value, num_v=hops + 1
        )
        return before, context, after, variables[0], prefix, value

    def _vt_icl(self, counter: Any, params: dict[str, Any]) -> str:
        """RULER's worked example: the largest noise count whose full example (answer prefix and
        answer included) takes at most 500 tokens of raw text, generated once per tokenizer."""
        if counter.name not in self._vt_example:
            chains, hops = params["num_chains"], params["num_hops"]

            def text(n: int) -> str:
                rng = random.Random(f"{self.seed}:vt:example")
                before, context, after, _, prefix, _ = self._vt_text(rng, n, chains, hops, icl=True)
                return before + context + after + prefix

            lowest = chains * (min(10, hops) + 1)
            fitted = fit_units(lambda n: counter.count_text(text(n)), VT_EXAMPLE_TOKENS, 5, lowest)
            n = fitted[0] if fitted else lowest
            rng = random.Random(f"{self.seed}:vt:example")
            before, context, after, variables, prefix, _ = self._vt_text(rng, n, chains, hops, icl=True)
            self._vt_example[counter.name] = (
                before + context + after + prefix + " " + " ".join(variables) + "\n"
            )
        return self._vt_example[counter.name]

    def _variable_tracking(
        self, rng: random.Random, n: int, example: str, type_haystack: str, num_chains: int, num_hops: int
    ) -> _Draft:
        del type_haystack  # RULER's vt task uses the noise haystack
        # RULER's randomize_icl: fresh names for the example's answer variables, a fresh value
        for name in example.strip().split()[-(min(10, num_hops) + 1) :]:
            example = example.replace(name, "".join(rng.choices(string.ascii_uppercase, k=len(name))))
        example = example.replace("12345", str(rng.randint(10000, 99998)))
        before, context, after, variables, prefix, value = self._vt_text(
            rng, n, num_chains, num_hops, icl=False
        )
        return _Draft(example + "\n" + before, context, after, prefix, variables, {"value": value})

    # ---- common words (RULER common_words_extraction.py) ---------------------------------------
    def _cw_example(
        self, rng: random.Random, num_words: int, common: int, uncommon: int, num_cw: int
    ) -> tuple[str, list[str]]:
        full = word_pool(num_words, rng)
        top, rest = full[:num_cw], full[num_cw:]
        listed = top * common + rest * uncommon
        random.Random(self.seed).shuffle(listed)  # RULER shuffles with its fixed seed
        return " ".join(f"{i + 1}. {word}" for i, word in enumerate(listed)), top

    def _common_words(
        self, rng: random.Random, n: int, length: int, freq_cw: int, freq_ucw: int, num_cw: int
    ) -> _Draft:
        family = TEMPLATES["common_words_extraction"]
        if length < 4096:  # RULER's short-context setting
            example, answer_example = self._cw_example(rng, 20, 3, 1, num_cw)
            context, answer = self._cw_example(rng, n, 6, 1, num_cw)
        else:
            example, answer_example = self._cw_example(rng, 40, 10, 3, num_cw)
            context, answer = self._cw_example(rng, n, freq_cw, freq_ucw, num_cw)
        before, after, prefix = _split_template(family["template"], family["answer_prefix"], query="")
        shot = (
            before
            + example
            + after
            + prefix
            + " "
            + " ".join(f"{i + 1}. {w}" for i, w in enumerate(answer_example))
        )
        return _Draft(shot + "\n" + before, context, after, prefix, answer, {"distinct_words": n})

    # ---- frequent words (RULER freq_words_extraction.py) --------------------------------------
    def _freq_words(self, rng: random.Random, n: int, vocab_size: int, alpha: float) -> _Draft:
        vocab = ["".join(rng.choices(string.ascii_lowercase, k=6)) for _ in range(vocab_size)]
        while len(set(vocab)) < vocab_size:
            vocab.append("".join(rng.choices(string.ascii_lowercase, k=6)))
        vocab = sorted(set(vocab))
        random.Random(self.seed).shuffle(vocab)
        vocab[0] = "..."  # the most frequent "word" is noise
        z = zeta(alpha)
        words = [w for k, w in enumerate(vocab, start=1) for _ in range(int(n * k**-alpha / z))]
        random.Random(self.seed).shuffle(words)
        family = TEMPLATES["freq_words_extraction"]
        before, after, prefix = _split_template(family["template"], family["answer_prefix"], query="")
        return _Draft(before, " ".join(words), after, prefix, vocab[1:4], {"coded_words": n})
