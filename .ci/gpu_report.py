"""The markdown report of ``.ci/gpu`` (standard library only, so it runs whatever else is broken).

``--env FILE`` alone: read the machine (GPU, driver, memory, library versions, CUDA devices) into
FILE as JSON and print it. With ``--steps``: render the report from the steps file that
``.ci/gpu`` wrote (``name, status, seconds, junit, log, note`` per line, tab separated), the junit
files of the pytest steps and the bench output; exit 0 when every step passed, 3 without CUDA,
1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

LIBRARIES = ("kvlab", "torch", "triton", "transformers", "lightning", "gguf", "pytest")
TRIM = 2500  # characters of a failure's message kept in the report


def machine() -> dict:
    """The GPU (nvidia-smi), the Python libraries' versions and what torch sees."""
    env: dict = {"python": platform.python_version(), "host": platform.node(), "versions": {}}
    for name in LIBRARIES:
        try:
            env["versions"][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            env["versions"][name] = None
    try:
        query = "name,driver_version,memory.total,clocks.max.memory"
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout  # fmt: skip
        env["nvidia_smi"] = [line.strip() for line in out.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError) as exc:
        env["nvidia_smi"] = [f"nvidia-smi failed: {exc}"]
    try:
        import torch

        env["torch_cuda"] = torch.version.cuda
        env["cuda"] = torch.cuda.is_available()
        env["devices"] = [
            f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))}, "
            f"{torch.cuda.get_device_properties(i).multi_processor_count} SMs)"
            for i in range(torch.cuda.device_count())
        ]
    except Exception as exc:  # a broken torch is a finding, not a crash of the report
        env["cuda"], env["devices"] = False, [f"torch failed: {exc}"]
    return env


def junit_cases(path: str) -> list[dict]:
    """Every testcase of a junit file: id, outcome, seconds, message, properties."""
    if not path or not Path(path).is_file():
        return []
    cases = []
    for case in ET.parse(path).iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or "") + (
                    "\n" + node.text if node.text and tag != "skipped" else ""
                )
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        cases.append({"id": name, "outcome": outcome, "seconds": float(case.get("time") or 0),
                      "message": message.strip(), "properties": props})  # fmt: skip
    return cases


def bench_section(path: str) -> list[str]:
    """The bench's own output (its title, peak, table and targets), without the step markers."""
    if not path or not Path(path).is_file():
        return ["(the bench did not run)"]
    lines = [line for line in Path(path).read_text().splitlines() if not line.startswith("== ")]
    first = next((i for i, line in enumerate(lines) if line.startswith("kvlab bench kernels on")), None)
    if first is None:
        return ["(no bench table: see gpu_bench.log)", "", "```", *lines[-40:], "```"]
    return lines[first:]


def perf_section(path: str) -> list[str]:
    """The performance benches' output: each step's marker line becomes a heading, its output a
    block as the bench printed it."""
    out: list[str] = []
    block: list[str] = []
    for line in Path(path).read_text().splitlines():
        if line.startswith("== ") and "(at most" in line:
            out += [
                *(["```", *block, "```", ""] if block else []),
                f"### {line[3:].split(' (at most')[0]}",
                "",
            ]
            block = []
        elif not line.startswith("== "):
            block.append(line)
    return out + (["```", *block, "```", ""] if block else [])


def figures(cases: list[dict]) -> list[str]:
    """One table per test function with recorded properties: a row per parametrised case."""
    by_test: dict[str, list[dict]] = defaultdict(list)
    for case in cases:
        if case["properties"]:
            by_test[case["id"].split("[")[0]].append(case)
    out = []
    for test, rows in by_test.items():
        keys = list(dict.fromkeys(k for row in rows for k in row["properties"]))
        out += [
            f"`{test}`",
            "",
            "| case | outcome | " + " | ".join(keys) + " |",
            "|---" * (len(keys) + 2) + "|",
        ]
        for row in rows:
            case = row["id"].split("[", 1)[1].rstrip("]") if "[" in row["id"] else row["id"]
            values = [row["properties"].get(k, "") for k in keys]
            out.append(f"| {case} | {row['outcome']} | " + " | ".join(values) + " |")
        out.append("")
    return out


def render(args: argparse.Namespace) -> int:
    env = json.loads(Path(args.env).read_text()) if Path(args.env).is_file() else {}
    steps = [line.split("\t") for line in Path(args.steps).read_text().splitlines() if line.strip()]
    cuda = bool(env.get("cuda"))
    rows, failures, skips, all_cases = [], [], Counter(), []
    for name, status, seconds, junit, _log, note in (s + [""] * (6 - len(s)) for s in steps):
        cases = junit_cases(junit)
        all_cases += cases
        counts = Counter(case["outcome"] for case in cases)
        tally = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "-"
        rows.append(f"| {name} | {status} | {tally} | {seconds} | {note} |")
        failures += [case for case in cases if case["outcome"] in ("failed", "error")]
        skips.update(case["message"].split("\n")[0][:160] for case in cases if case["outcome"] == "skipped")
    bad = [s for s in steps if s[1] not in ("passed", "skipped")]
    if not cuda:
        verdict, status = "NO CUDA: the GPU tier was skipped and nothing was checked", 3
    elif bad or failures:
        verdict, status = "FAILED", 1
    else:
        verdict, status = "PASSED", 0
    versions = ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items() if v)
    gpu = "; ".join(env.get("nvidia_smi", [])) or "-"
    devices = "; ".join(env.get("devices", [])) or "none"
    out = [
        f"# kvlab GPU check (`.ci/gpu --part {args.part}`): {verdict}",
        "",
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {args.seconds} s of steps.",
        "",
        "| machine | |",
        "|---|---|",
        f"| GPU (nvidia-smi: name, driver, memory, max memory clock) | {gpu} |",
        f"| CUDA devices torch sees | {devices} (CUDA {env.get('torch_cuda')}) |",
        f"| Python {env.get('python')} | {versions} |",
        "",
        "| step | status | tests | seconds | note |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ]  # fmt: skip
    if failures:
        out += ["## Failures", ""]
        for case in failures:
            out += [f"### {case['id']}", "", "```", case["message"][:TRIM], "```", ""]
    if skips:
        out += ["## Skipped", "", *(f"- {n} x {reason}" for reason, n in skips.most_common()), ""]
    table = figures(all_cases)
    if table:
        out += ["## Measured figures (the tests' recorded properties)", "", *table]
    if any(name == "kvlab bench kernels" for name, *_ in steps):
        out += ["## kvlab bench kernels", "", *bench_section(args.bench), ""]
    if args.perf and Path(args.perf).is_file():
        out += ["## Performance benches (`--part perf`)", "", *perf_section(args.perf)]
    Path(args.out).write_text("\n".join(out) + "\n")
    print("\n".join(out[: 12 + len(rows)]))
    return status


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", required=True)
    p.add_argument("--steps")
    p.add_argument("--part", default="core")
    p.add_argument("--bench", default="")
    p.add_argument("--perf", default="")
    p.add_argument("--seconds", default="?")
    p.add_argument("--out", default="gpu_report.md")
    args = p.parse_args()
    if args.steps is None:
        env = machine()
        Path(args.env).write_text(json.dumps(env, indent=1))
        print(json.dumps(env, indent=1))
        return 0
    return render(args)


if __name__ == "__main__":
    sys.exit(main())
