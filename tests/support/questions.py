"""Questions on shared contexts: samples whose prompt is a context followed by a question, as the
compression protocols (``model.protocol``, docs/protocols.md) split them."""

from kvlab.data.sample import Sample

CONTEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. " * 3


def sample(sid: str, question: str, context: str = CONTEXT, **fields) -> Sample:
    """A sample whose prompt is ``context + question``."""
    return Sample(id=sid, prompt=context + question, question=question, **fields)


#: three questions on one context (``context_id`` fox), one on another
QUESTIONS = [
    sample("a", "What jumps over the dog?", answer_prefix="Answer:", context_id="fox"),
    sample("b", "Who sleeps?", context_id="fox", max_new_tokens=3),
    sample("c", "Where does the cat sleep, and for how long does it stay there?", context_id="fox"),
    sample("d", "Name a color.", context="A short note about colors. "),
]
