"""Regenerates the report's pictures in docs/images (the ones docs/report.md shows).

    python docs/.pictures/make.py        # about a minute; needs headless Chromium

It runs ``python -m dtcompile.demo --trace DIR`` (the Llama-3-8B-sized TP + SP block on 8
fake ranks, priced as an H100), draws it with ``dtcompile-report``, and screenshots three
parts of the page with headless Chromium, each alone on a page with the report's own
style: the forward graph's timeline (before and after the passes), its memory picture,
and its passes' decisions.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

IMAGES = Path(__file__).resolve().parents[1] / "images"
WIDTH = 1000


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    sys.exit("make.py: no headless Chromium (chromium, chromium-browser or google-chrome) on PATH")


def _parts(page: str) -> dict[str, str]:
    """The forward graph's (compile 1/0) timeline and memory figures and its passes table."""
    compile_1 = page[page.index("<h2>Compile 1/0"):page.index("<h2>Compile 2/0")]
    style = re.search(r"<style>.*?</style>", page, flags=re.DOTALL).group(0)
    timeline = re.search(r'<figure><svg class="timeline".*?</figure>', compile_1, flags=re.DOTALL).group(0)
    memory = re.search(r'<figure><svg class="memory".*?</figure>', compile_1, flags=re.DOTALL).group(0)
    passes = re.search(r"<h3>Passes</h3>(<table>.*?</table>)", compile_1, flags=re.DOTALL).group(1)
    head = f"<!DOCTYPE html><html><head><meta charset='utf-8'>{style}</head><body style='margin:8px'>"
    return {name: f"{head}{part}</body></html>"
            for name, part in (("report-timeline", timeline), ("report-memory", memory), ("report-passes", passes))}


def main() -> None:
    chromium = _chromium()
    with tempfile.TemporaryDirectory() as tmp:
        trace, out = Path(tmp) / "trace", Path(tmp) / "report"
        subprocess.run([sys.executable, "-m", "dtcompile.demo", "--trace", str(trace)], check=True)
        subprocess.run(["dtcompile-report", str(trace), "-o", str(out)], check=True)
        IMAGES.mkdir(exist_ok=True)
        heights = {"report-timeline": 200, "report-memory": 250, "report-passes": 560}
        for name, html in _parts((out / "index.html").read_text()).items():
            source = Path(tmp) / f"{name}.html"
            source.write_text(html)
            subprocess.run(
                [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                 f"--window-size={WIDTH},{heights[name]}", f"--screenshot={IMAGES / f'{name}.png'}", source.as_uri()],
                check=True, capture_output=True,
            )
            print(f"wrote {IMAGES / f'{name}.png'}")


if __name__ == "__main__":
    main()
