"""The decode loop reads device data on the host only where the algorithm needs it: a bound per
decode step, not per layer, for every shipped preset (and the H2O decode policy).

Counted on CPU with :class:`host_syncs.HostSyncs` (a ``TorchDispatchMode`` over the aten ops that
read device data on the host, plus wrapped ``tolist`` / ``numpy`` / ``cpu``; see its docstring),
between two consecutive ``on_step`` calls of :func:`kvlab.engine.generation.decode`: the stop
check, the model's forward over the compressed cache and the decode policy. What the algorithm
needs per step:

- greedy decoding's stop check (``finished.all()``, one read: the loop must know whether to go on);
- PrefixKV's ``fixed_index_evict``: one read of every layer's eviction decisions (the decode
  region's new length is a host value).

Reads made only by the CPU torch path are not counted (:data:`CPU_ONLY`): the segment runs of
the in-place decode attention, which no other device computes.
``PYTHONPATH=tests python tests/engine/test_host_syncs.py`` prints the table in ``docs/benchmarks.md``.
"""

import functools
import sys
import tempfile

import pytest
from support import e2e
from support.host_syncs import POLICY_READS, counting_steps, describe
from support.preset_runs import is_vlm_preset, preset_compression, preset_models, preset_samples

from kvlab.config.loader import preset_names
from kvlab.engine.generation import decode
from kvlab.pipeline import Pipeline

STEPS = 6  # tokens generated: 5 forwards, 4 whole steps between on_step calls
#: reads that only the CPU path makes (function of a counted origin): the strided segment runs
CPU_ONLY = ("kernels/decode_attention.py:", "(of)")
H2O_DECODE = "h2o+decode"  # the h2o preset with the h2o decode policy (evict_one every step)
CASES = [(name, model) for name in preset_names() for model in preset_models(name)]
CASES += [(H2O_DECODE, model) for model in preset_models("h2o")]


def compression(name: str, model: str, visual_heads) -> dict:
    if name == H2O_DECODE:
        return {**preset_compression("h2o", model, visual_heads), "decode": {"name": "h2o"}}
    return preset_compression(name, model, visual_heads)


def counted(origin: str) -> bool:
    where = origin.split(" at ", 1)[1]  # kernels/... or kvlab/kernels/... (a linked kernels folder)
    return not (
        (where.startswith(CPU_ONLY[0]) or f"/{CPU_ONLY[0]}" in where) and origin.endswith(CPU_ONLY[1])
    )


@functools.cache
def step_reads(name: str, model: str, visual_heads) -> tuple[int, str, int]:
    """``(most reads in one decode step, where they come from, the bound the pipeline's decode
    policy allows)``."""
    loaded = e2e.kvlab_model(model)
    pipeline = Pipeline.from_config(compression(name, model, visual_heads))
    batch = loaded.processor.collate(preset_samples(is_vlm_preset(name.split("+")[0])))
    state = e2e.prefill_batch(loaded, pipeline, batch, STEPS)
    with counting_steps() as (syncs, on_step):
        decode(state, STEPS, on_step=on_step)
    assert len(syncs.steps) == STEPS - 2, "the decode stopped early (an end-of-sequence token)"
    steps = [type(c)({k: n for k, n in c.items() if counted(k)}) for c in syncs.steps]
    worst = max(steps, key=lambda c: sum(c.values()))
    return sum(worst.values()), describe(worst), 1 + POLICY_READS[pipeline.decode_policy.registry_name]


@pytest.mark.parametrize(("preset", "model"), CASES)
def test_decode_steps_read_the_device_only_where_the_algorithm_needs_it(preset, model, visual_heads):
    reads, where, bound = step_reads(preset, model, visual_heads)
    assert reads <= bound, f"{preset}/{model}: {reads} host reads in one decode step: {where}"


@pytest.mark.parametrize("preset", [name for name, model in CASES if model == "tiny-llama"])
def test_host_reads_per_step_do_not_grow_with_the_layers(preset, visual_heads):
    """tiny-llama has 2 layers, tiny-qwen2 3: a read per layer would differ."""
    llama, qwen = (step_reads(preset, model, visual_heads)[0] for model in ("tiny-llama", "tiny-qwen2"))
    assert llama == qwen


if __name__ == "__main__":  # the table of docs/benchmarks.md
    from kvlab.calibration.synthetic import synthetic_visual_heads

    def heads(info):
        return synthetic_visual_heads(info, tempfile.mkdtemp(prefix="kvlab-vh-"))

    print("| preset | model | host reads per decode step | bound | from |")
    print("|---|---|---|---|---|")
    for name, model in CASES:
        reads, where, bound = step_reads(name, model, heads)
        print(f"| {name} | {model} | {reads} | {bound} | {where} |", file=sys.stdout, flush=True)
