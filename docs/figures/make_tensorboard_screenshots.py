"""Regenerate ``docs/figures/tensorboard_*.png`` (``docs/evaluation.md``) and ``reader_kept_patches.png``.

A standalone script (not part of kvlab, not collected by pytest), run from the repository root::

    python docs/figures/make_tensorboard_screenshots.py            # runs, TensorBoard, screenshots
    python docs/figures/make_tensorboard_screenshots.py --skip-runs  # reuse the runs under --root

1. Makes small ``kvlab predict`` runs under ``<root>/runs`` (default ``/tmp/tbshots``), built-in
   models only, offline: experiment ``demo`` (SmolLM2-135M on 2 synthetic retrieval prompts: a
   SnapKV budget sweep at 10/25/50% of the prompt, AdaKV and MixKV on SnapKV at 128 tokens) and
   experiment ``reader`` (``smollm2-reader``: SnapKV at 50% on the first ``reader_code`` sample,
   LOOK-M on one sample of each reader task), then ``kvlab compare`` on each experiment.
2. Writes ``reader_kept_patches.png``: the ``patches/layer_29/image_2`` figure of the reader SnapKV
   run, read back from its TensorBoard event file.
3. Starts TensorBoard on ``<root>/runs``, drives Debian's Chromium headless with Playwright
   (viewport 1400 x 900, TensorBoard's default card size) and saves ``tensorboard_hparams.png``,
   ``tensorboard_text.png``, ``tensorboard_images.png`` and ``tensorboard_patches.png`` into
   ``docs/figures/``; then stops TensorBoard and the browser.

Needs the ``playwright`` Python package, ``/usr/bin/chromium`` and ``tensorboard``; downloads
nothing (``HF_HUB_OFFLINE=1``). The runs take a few minutes each on a loaded 2-core machine.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

FIGURES = Path(__file__).resolve().parent
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1400, "height": 900}
CARDS = (0, 0, 1150, 510)  # TIME SERIES: the run list and the first row of cards, not the settings pane
TEXT_SMALL = ["--data.limit", "2", "--model.inspect_samples", "1"]
READER_CODE = "{name: reader, tasks: [reader_code], samples_per_task: 1}"
READER_ALL = "{name: reader, samples_per_task: 1}"
PATCH_TAG = "patches/layer_29/image_2"  # last layer of smollm2-reader, the image holding the code


def runs(runs_dir: Path) -> list[list[str]]:
    """The ``kvlab`` commands that make the runs (in order)."""
    common = ["--run.dir", str(runs_dir)]
    demo = [*common, "--run.experiment", "demo", *TEXT_SMALL]
    reader = [*common, "--run.experiment", "reader", "--model.model", "smollm2-reader"]
    reader += ["--model.fidelity", "false"]
    return [
        ["kvlab", "predict", "--config", "snapkv", *demo, "--model.compression.budget", "0.1,0.25,0.5"],
        ["kvlab", "predict", "--config", "adakv", *demo],
        ["kvlab", "predict", "--config", "mixkv_snapkv", *demo],
        ["kvlab", "predict", "--config", "snapkv", *reader, "--data.dataset", READER_CODE,
         "--model.compression.budget.ratio", "0.5", "--run.method", "snapkv@budget=0.5"],
        ["kvlab", "predict", "--config", "lookm", *reader, "--data.dataset", READER_ALL,
         "--run.method", "lookm"],
        ["kvlab", "compare", str(runs_dir / "demo")],
        ["kvlab", "compare", str(runs_dir / "reader")],
    ]  # fmt: skip


def make_runs(runs_dir: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for cmd in runs(runs_dir):
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env=env)


def reader_figure(runs_dir: Path, out: Path) -> None:
    """The kept-patch figure of the reader SnapKV run, as TensorBoard stored it."""
    from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator

    events = runs_dir / "reader" / "snapkv@budget=0.5" / "tensorboard"
    acc = EventAccumulator(str(events), size_guidance={IMAGES: 0})
    acc.Reload()
    image = acc.Images(PATCH_TAG)[0]
    out.write_bytes(image.encoded_image_string)
    print(f"wrote {out} ({PATCH_TAG}, step {image.step}, {image.width}x{image.height})")


def start_tensorboard(logdir: Path, port: int) -> subprocess.Popen:
    tb = shutil.which("tensorboard") or "tensorboard"
    proc = subprocess.Popen(
        [tb, "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port), "--reload_interval", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(120):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs", timeout=2)
            return proc
        except OSError:
            time.sleep(1)
    proc.terminate()
    raise RuntimeError("TensorBoard did not start")


def save(png: bytes, out: Path, crop: tuple[int, int, int, int] | None = None) -> None:
    """Saves a screenshot, cropped to ``(left, top, right, bottom)``, as an 8-bit palette PNG (small)."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    if crop:
        image = image.crop(crop)
    image.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(out, optimize=True)
    print(f"wrote {out} ({out.stat().st_size // 1024} KB)")


def settle(page, ms: int = 6000) -> None:
    """Waits for the requests to end, then ``ms`` more for TensorBoard to draw."""
    page.wait_for_load_state("networkidle")
    page.wait_for_timeout(ms)


def time_series(page, url: str, runs: str, tags: str) -> None:
    """The TIME SERIES tab narrowed to the runs and tags matching the regexes."""
    page.goto(url + "#timeseries")
    settle(page)
    page.locator('input[placeholder="Filter runs (regex)"]').press_sequentially(runs, delay=30)
    page.locator('input[placeholder="Filter tags (regex)"]').fill(tags)
    page.keyboard.press("Escape")  # closes the tag completion list
    settle(page)


def screenshots(port: int, out_dir: Path) -> None:
    from playwright.sync_api import sync_playwright

    url = f"http://127.0.0.1:{port}/"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)

            page.goto(url + "#hparams")  # the experiment's configuration orders the columns
            settle(page, 8000)
            save(page.screenshot(), out_dir / "tensorboard_hparams.png")

            page.goto(url + "#text")
            settle(page)
            page.get_by_label("Write a regex to filter runs").fill("demo/adakv")
            page.get_by_label("Filter tags (regular expressions supported)").fill("results/metrics")
            settle(page)
            save(page.screenshot(), out_dir / "tensorboard_text.png")

            time_series(page, url, "demo/adakv", "budget/kept_(layer_head|per_layer)$")
            save(page.screenshot(), out_dir / "tensorboard_images.png", crop=CARDS)

            time_series(page, url, "reader/snapkv", PATCH_TAG + "$")
            save(page.screenshot(), out_dir / "tensorboard_patches.png", crop=CARDS)
        finally:
            browser.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/tbshots"))
    parser.add_argument("--port", type=int, default=6006)
    parser.add_argument("--skip-runs", action="store_true", help="reuse the runs under --root")
    parser.add_argument("--only-runs", action="store_true", help="make the runs and stop")
    args = parser.parse_args(argv)
    runs_dir = args.root / "runs"
    if not args.skip_runs:
        make_runs(runs_dir)
    if args.only_runs:
        return 0
    reader_figure(runs_dir, FIGURES / "reader_kept_patches.png")
    tensorboard = start_tensorboard(runs_dir, args.port)
    try:
        screenshots(args.port, FIGURES)
    finally:
        tensorboard.terminate()
        tensorboard.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
