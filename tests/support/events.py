"""TensorBoard event files of a run, read back whole (no sampling: every scalar, image,
histogram and tensor event), for the tests of what kvlab logs."""

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

#: 0 keeps every event of a kind (TensorBoard's default samples scalars, images and histograms)
EVERY_EVENT = {"scalars": 0, "images": 0, "histograms": 0, "tensors": 0}


def read_events(directory) -> EventAccumulator:
    """Every event under ``directory`` (one TensorBoard run), loaded."""
    acc = EventAccumulator(str(directory), size_guidance=EVERY_EVENT)
    acc.Reload()
    return acc
