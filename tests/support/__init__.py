"""Helpers the tests share (never tests themselves): importable from every test folder as
``support.<module>`` because tests/conftest.py puts tests/ on ``sys.path``.

- :mod:`support.e2e`: built-in models routed through kvlab (loaded once), a batch's run, the
  batch-equals-alone check.
- :mod:`support.preset_runs`: one fixed run of a shipped preset (what the preset regression and
  the GPU tier compare).
- :mod:`support.presets`: a shipped preset's compression with another budget, its samples.
- :mod:`support.host_syncs`: counting the reads of device data by the host, on CPU.
- :mod:`support.cli`: ``kvlab predict`` into a temporary run directory, JSONL files, metrics
  without their timings.
- :mod:`support.attention_variants`: tiny transformers models of each attention variant.
- :mod:`support.modality`: text/image contexts and samples for the modality allocators.
- :mod:`support.questions`: several questions on one shared context (the protocols).
- :mod:`support.tokenizers`: the tiny BPE with a BOS token and a chosen chat template.
- :mod:`support.kernel_cases`: the Triton kernels' inputs and cases (CPU tests, compile check,
  GPU tier).
- :mod:`support.records`: fake per-sample records for the run metrics.

The naive references of the component tests are the package :mod:`naive`.
"""
