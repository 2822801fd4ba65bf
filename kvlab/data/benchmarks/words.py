"""Word lists of the offline generators (RULER keys and common words), shipped as code.

RULER draws needle keys as "adjective-noun" pairs and common-words lists from the
``wonderwords`` package's lists (and, past their size, from an English word list it downloads);
kvlab ships the fixed lists below instead: 127 adjectives x 155 nouns = 19,685 keys, and 372
single words extended, when a list needs more, by joining two of them ("lanternmeadow").
"""

from __future__ import annotations

import random


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


ADJECTIVES: tuple[str, ...] = _words(
    """
    able acidic agile airy amber ancient angry arctic ashen autumn awful bitter blank bold
    brave brief bright brisk broad brown busy calm candid careful casual cheap cheerful chilly
    civil clever cloudy clumsy coastal cold common cosmic crisp cruel curly curved damp daring
    dark deep dense distant dizzy drowsy dry dusty eager early earthy easy elegant empty exotic
    faint fancy feeble fierce flat fluffy fond fragile frank fresh frosty fuzzy gentle giant
    gifted glad gloomy golden graceful grand greedy green grumpy hasty healthy heavy hidden
    hollow honest humble icy idle jolly juicy keen kind lazy little lively lonely loud lucky
    mellow merry mighty misty modest moody muddy narrow neat nervous noble noisy odd orange
    pale patient plain polite proud purple quick quiet rapid rare rich rough round rusty
    """
)
NOUNS: tuple[str, ...] = _words(
    """
    acorn anchor apple arrow badge bagel ballad banjo barrel basket beacon beetle bell bench
    blanket blossom bottle bracelet branch bridge bucket buffalo button cabin cactus camel
    candle canoe canyon carpet castle cedar chair cherry chimney circus cliff clock cloud
    comet compass copper cottage crayon cricket crown cupboard curtain cushion daisy desert
    diamond dolphin donkey dragon drum eagle easel elbow engine falcon feather fence ferry
    fiddle fjord flag flute forest fountain garden garlic gazelle glacier glove goblet gravel
    guitar hammer harbor harvest helmet hermit hill hornet island ivory jacket jasmine jelly
    kettle kitten ladder lagoon lantern lemon lizard locket magnet mango maple marble meadow
    melon mirror mitten monkey mountain muffin needle nest notebook oasis orchard otter oyster
    paddle palace panther parrot peach pebble pencil pepper piano pillow pioneer planet pocket
    pony potato prairie pumpkin puzzle quarry quill rabbit raft rainbow raven ribbon river
    rocket saddle sailor salmon sandal scarf shovel signal silver sparrow spider sponge statue
    """
)
VERBS: tuple[str, ...] = _words(
    """
    admire argue bake balance bargain blink borrow bounce breathe build calculate carry chase
    climb collect comfort cook crawl dance decide deliver describe dig dream drift elect
    embrace escape explore fasten fetch float fold gather giggle glide grow guard hover hurry
    imagine inspect invent juggle jump kneel knit launch listen march measure melt mend
    mumble navigate nod obey observe organize paint paddle pause perform plant polish pour
    pretend protect pull punish question quiver race reach recite relax remember repair
    rescue return rhyme rinse roam rush scatter scribble search settle shiver sketch skip
    """
)
#: the single words of the common-words task (nouns, adjectives and verbs), sorted
SINGLE_WORDS: tuple[str, ...] = tuple(sorted(set(NOUNS) | set(ADJECTIVES) | set(VERBS)))


def key_words() -> list[str]:
    """RULER's needle-key words: every "adjective-noun" pair, sorted."""
    return sorted(f"{adj}-{noun}" for adj in ADJECTIVES for noun in NOUNS)


def word_pool(n: int, rng: random.Random) -> list[str]:
    """``n`` distinct words drawn from :data:`SINGLE_WORDS`, or from two-word compounds of them
    when ``n`` is larger than that list (RULER samples its larger English list there)."""
    if n <= len(SINGLE_WORDS):
        return rng.sample(list(SINGLE_WORDS), n)
    size = len(SINGLE_WORDS)
    if n > size * (size - 1):
        raise ValueError(f"cannot draw {n} distinct words (at most {size * (size - 1)})")
    picks = rng.sample(range(size * size), min(size * size, n + 2 * size))
    compounds = dict.fromkeys(
        SINGLE_WORDS[i // size] + SINGLE_WORDS[i % size] for i in picks if i // size != i % size
    )
    if len(compounds) < n:
        raise ValueError(f"cannot draw {n} distinct words")
    return list(compounds)[:n]
