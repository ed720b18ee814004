"""report.html renders its figures in headless Chromium, with no network and no scripts."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from kvreplay.report.build import build_report

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
# Added to a copy of the page only: records each image's decoded size once it has loaded.
SIZE_PROBE = (
    '<script>addEventListener("load", () => { document.body.dataset.imageSizes ='
    ' [...document.images].map(i => i.naturalWidth + "x" + i.naturalHeight).join(","); });'
    "</script>"
)


def chromium(profile: Path, *arguments: str) -> str:
    result = subprocess.run(
        [str(CHROMIUM), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *arguments],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return result.stdout


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian chromium at /usr/bin/chromium")
def test_report_figures_render_in_chromium(synthetic_run: Path, tmp_path: Path) -> None:  # noqa: F811
    paths = build_report(synthetic_run)
    page = paths.html.read_text(encoding="utf-8")

    screenshot = tmp_path / "report.png"
    chromium(
        tmp_path / "profile-shot",
        f"--screenshot={screenshot}",
        "--window-size=1200,3000",
        paths.html.as_uri(),
    )
    pixels = imread(screenshot)[..., :3]
    assert pixels.shape[:2] == (3000, 1200)
    ink = np.mean(np.any(pixels < 0.85, axis=-1))
    coloured = np.mean(np.ptp(pixels, axis=-1) > 0.25)  # bars and lines, not black text
    assert ink > 0.03, f"only {ink:.1%} of the screenshot is not white"
    assert coloured > 0.01, f"only {coloured:.1%} of the screenshot is coloured: figures missing"

    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", SIZE_PROBE + "</body>"), encoding="utf-8")
    dom = chromium(
        tmp_path / "profile-dom", "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()
    )
    assert dom.count("<img ") == len(paths.figures) == 5
    sizes = re.search(r'data-image-sizes="([^"]*)"', dom)
    assert sizes, "the load-time probe did not run"
    for size in sizes.group(1).split(","):
        width, height = map(int, size.split("x"))
        assert width > 300 and height > 200, f"an image decoded to {size}"
