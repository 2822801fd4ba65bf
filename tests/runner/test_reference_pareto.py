"""Tests for ``kvlab reference-table --formats`` (kvlab.runner.reference_pareto): the formats, the
Pareto front against a pairwise check, the table of fabricated cells, the CLI on a tiny model."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from naive.pareto import naive_pareto_front

from kvlab.cli import reference_table as reference_command
from kvlab.cli.main import main
from kvlab.config.errors import ConfigError
from kvlab.runner import reference_pareto as pareto
from kvlab.runner import reference_table as reference

TASK = {"name": "synthetic_retrieval", "context_tokens": 512, "num_samples": 2}
RUN = {"dir": "d", "experiment": "e", "method": "m"}


def test_formats_parse_and_refuse_unknown_names() -> None:
    assert pareto.parse_formats("none,kivi2,turbo3") == ("none", "kivi2", "turbo3")
    assert list(pareto.FORMATS) == ["none", "int8", "int4", "kivi2", "turbo3", "turbo3mse"]
    for bad, problem in (
        ("none,int3", "unknown 'int3'"),
        ("int8,int8", "'int8' given twice"),
        (",", "no name"),
    ):
        with pytest.raises(ConfigError) as info:
            pareto.parse_formats(bad)
        message = str(info.value)
        assert "--formats" in message and problem in message and repr(bad) in message
        assert all(name in message for name in pareto.FORMATS)


def test_run_config_and_name_carry_the_format() -> None:
    kivi = reference.run_config("snapkv", 0.1, TASK, RUN, quantize=pareto.FORMATS["kivi2"])
    assert kivi["model"]["compression"]["quantize"] == {
        "name": "kivi",
        "bits": 2,
        "group": 32,
        "residual": 128,
    }
    assert kivi["model"]["compression"]["budget"] == {"window": 32, "ratio": 0.1}
    full = reference.run_config("full", None, TASK, RUN, quantize=pareto.FORMATS["int8"])
    assert full["model"]["compression"] == {"quantize": {"name": "per_token", "bits": 8}}
    assert "quantize" not in reference.run_config("snapkv", 0.1, TASK, RUN)["model"]["compression"]
    names = [c.name for c in pareto.crossing(reference.cells(("full", "snapkv"), (0.1,)), ("none", "int4"))]
    assert names == ["full", "full@quantize=int4", "snapkv@budget=0.1", "snapkv@budget=0.1,quantize=int4"]


def test_pareto_front_equals_the_pairwise_check() -> None:
    rng = random.Random(0)
    for trial in range(300):  # small integer grids: ties in bytes, in score and in both
        n = rng.randint(1, 12)
        points = [(float(rng.randint(1, 6)), float(rng.randint(0, 4))) for _ in range(n)]
        assert pareto.pareto_front(points) == naive_pareto_front(points), (trial, points)
    # by hand: (2, 50) dominates (3, 40); (1, 10) and the two equal (2, 50) stay; (4, 90) stays
    assert pareto.pareto_front([(3, 40), (1, 10), (2, 50), (4, 90), (2, 50), (5, 90)]) == {1, 2, 3, 4}
    assert pareto.pareto_front([]) == set()


def _run(root: Path, name: str, scores: list[float], kept: int, full: int = 1000, **extra: int) -> None:
    """A fabricated run: one record per sample, ids s0, s1, ... with its kept and full bytes."""
    path = root / name
    path.mkdir(parents=True)
    lines = [
        json.dumps(
            {"id": f"s{i}", "contains_answer": s, "kv_bytes_kept": kept, "kv_bytes_full": full, **extra}
        )
        for i, s in enumerate(scores)
    ]
    (path / "predictions.jsonl").write_text("\n".join(lines) + "\n")


def test_pareto_table_of_fabricated_cells(tmp_path: Path) -> None:
    mib = 2**20
    _run(tmp_path, "full", [1.0] * 8, 8 * mib, 8 * mib)
    _run(tmp_path, "full@quantize=int4", [1.0] * 8, 2 * mib, 8 * mib)
    _run(tmp_path, "snapkv@budget=0.1", [1.0] * 4 + [0.0] * 4, mib, 8 * mib)
    _run(tmp_path, "snapkv@budget=0.1,quantize=int4", [0.0] * 8, mib // 4, 8 * mib)
    # a retrieving run: its device bytes count, not its kept entries
    _run(tmp_path, "retrieval@budget=0.1", [1.0] * 8, 0, 8 * mib, kv_bytes_device=3 * mib)
    cells = pareto.crossing(reference.cells(("full", "snapkv", "retrieval"), (0.1,)), ("none", "int4"))
    results = {c: pareto.cell_result(tmp_path / c.name, "contains_answer", ("t", "t")) for c in cells}
    refused = {pareto.Cell("retrieval", 0.1, "int4")}
    text = pareto.pareto_table(results, refused, pareto.REFERENCE)
    # Wilson 8/8 [67.6, 100], 4/8 [21.5, 78.5], 0/8 [0, 32.4]; McNemar against full 8/8: 0/8 has 8
    # discordant samples, p = 2/2^8 (*), 4/8 has 4, p = 1/8. Front: 0.25 MiB at 0 (the fewest bytes),
    # 2 MiB at 100 (nothing under 2 MiB scores 100); 1 MiB at 50 is beaten by nothing with fewer
    # bytes (0.25 MiB scores 0), so it is on the front too; retrieval's 3 MiB and the full 8 MiB
    # score 100 with more bytes than int4's full cache.
    assert text.splitlines()[:8] == [
        "| method | format | budget | score (%) [95%] | kept KV MiB / sample | x full | Pareto |",
        "|---|---|---|---|---|---|---|",
        "| full | none | 100% | 100.0 [68, 100] | 8.00 | 1.000 |  |",
        "| full | int4 | 100% | 100.0 [68, 100] | 2.00 | 0.250 | front |",
        "| snapkv | none | 10% | 50.0 [22, 78] | 1.00 | 0.125 | front |",
        "| snapkv | int4 | 10% | 0.0 [0, 32]* | 0.25 | 0.031 | front |",
        "| retrieval | none | 10% | 100.0 [68, 100] | 3.00 | 0.375 |  |",
        "| retrieval | int4 | 10% | refused | - | - |  |",
    ]
    assert "Wilson score interval" in text and "Pareto front" in text and "kv_bytes_device" in text
    assert pareto.plot_pareto({"t": results}, tmp_path / "p.png", "t").stat().st_size > 10_000
    assert pareto.plot_pareto({"t": {c: None for c in cells}}, tmp_path / "q.png", "t") is None


def test_cli_end_to_end_two_formats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "evaluation.md"
    doc.write_text(f"x\n{pareto.PARETO_START}\n{pareto.PARETO_END}\ny\n")
    runs = tmp_path / "runs"
    args = ["reference-table", "--model", "tiny-llama", "--methods", "full,snapkv,retrieval",
            "--budgets", "0.5", "--formats", "none,kivi2", "--tasks", "retrieval-512", "--samples", "2",
            "--dir", str(runs), "--docs", str(doc), "--figure", str(tmp_path / "fig" / "p.png")]  # fmt: skip
    main(args)
    root = runs / "retrieval-512"
    names = ["full", "full@quantize=kivi2", "retrieval@budget=0.5", "snapkv@budget=0.5",
             "snapkv@budget=0.5,quantize=kivi2"]  # fmt: skip
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == names
    config = json.loads((root / "full@quantize=kivi2" / "run.json").read_text())["fields"]["model"]
    assert config["compression"]["quantize"]["name"] == "kivi"

    def kept(name: str) -> list[int]:
        return [json.loads(line)["kv_bytes_kept"] for line in (root / name / "predictions.jsonl").open()]

    # the same entries kept, stored as 2-bit codes beyond KIVI's 128-token residual: fewer bytes
    assert all(q < 0.5 * f for q, f in zip(kept("full@quantize=kivi2"), kept("full"), strict=True))
    assert all(
        q < f
        for q, f in zip(kept("snapkv@budget=0.5,quantize=kivi2"), kept("snapkv@budget=0.5"), strict=True)
    )
    text = doc.read_text()
    assert "| retrieval | kivi2 | 50% | refused | - | - |  |" in text
    assert "Refused, no run: `retrieval` as kivi2 at 50% on retrieval-512: model.compression.quantize" in text
    assert text.count("| front |") >= 1 and "| full | none | 100% | " in text
    assert text.split(pareto.PARETO_START)[1].split(pareto.PARETO_END)[0].strip() in capsys.readouterr().out
    assert (tmp_path / "fig" / "p.png").stat().st_size > 10_000
    # --resume keeps every finished run: nothing is run again
    stamps = {n: (root / n / "predictions.jsonl").stat().st_mtime_ns for n in names}
    main([*args, "--resume"])
    assert {n: (root / n / "predictions.jsonl").stat().st_mtime_ns for n in names} == stamps


def test_bad_formats_exit_2_before_any_run(tmp_path: Path) -> None:
    vlm, protocols = (
        ["--formats", "int8", "--suite", "vlm"],
        ["--formats", "int8", "--suite", "ruler", "--protocols", "query_agnostic"],
    )
    for bad in (["--formats", "fp8"], ["--formats", "none,none"], vlm, protocols):
        with pytest.raises(SystemExit) as info:
            main(["reference-table", "--model", "tiny-llama", "--dir", str(tmp_path), *bad])
        assert info.value.code == 2
    with pytest.raises(ConfigError, match="on --suite ruler under query_aware, not with --suite vlm; drop"):
        reference_command.main(["--dir", str(tmp_path), *vlm])
    with pytest.raises(ConfigError, match="not with --protocols; drop --protocols"):
        reference_command.main(["--dir", str(tmp_path), *protocols])
    with pytest.raises(ConfigError, match="--figure apply to --suite ruler or vlm only"):
        reference_command.main(["--dir", str(tmp_path), "--figure", str(tmp_path / "f.png")])
    assert not any(tmp_path.iterdir())


def test_the_ruler_suite_crossed_with_formats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--suite ruler --formats``: the RULER-style suite is one dataset under ``<dir>/ruler/``, each
    (method, format) one run on it, scored by ``string_match_all``."""
    runs = tmp_path / "runs"
    main(["reference-table", "--model", "tiny-llama", "--suite", "ruler", "--methods", "full,snapkv",
          "--budgets", "0.5", "--formats", "none,int4", "--tasks", "niah_single_2", "--lengths", "512",
          "--samples", "2", "--dir", str(runs)])  # fmt: skip
    root = runs / "ruler"
    names = ["full", "full@quantize=int4", "snapkv@budget=0.5", "snapkv@budget=0.5,quantize=int4"]
    assert sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != "reference") == names
    record = json.loads((root / "snapkv@budget=0.5,quantize=int4" / "predictions.jsonl").open().readline())
    assert record["meta"]["task"] == "niah_single_2" and "string_match_all" in record
    out = capsys.readouterr().out
    assert "**ruler**, `string_match_all` (%)" in out and "| snapkv | int4 | 50% |" in out
