"""Regenerate the dashboard screenshots in docs/img/ from a demo run (not run in CI).

Runs `hdi-monitor demo` (or takes an existing run with ``--logdir``), starts TensorBoard on it,
and takes headless Chromium screenshots of the Custom Scalars, Images and Scalars tabs:

    PYTHONPATH=. python benchmarks/screenshots.py                 # the full demo, then screenshots
    PYTHONPATH=. python benchmarks/screenshots.py --logdir runs/demo/version_0

Needs the Debian package ``chromium`` (``apt-get install -y chromium``) and TensorBoard.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: tab -> (URL fragment, output file, window height). Smoothing off, outliers kept in the charts.
TABS = {
    "custom_scalars": (
        "#custom_scalars&_smoothingWeight=0&_ignoreYOutliers=false",
        "dashboard_custom_scalars.png",
        1500,
    ),
    "images": ("#images&_smoothingWeight=0", "dashboard_images.png", 2300),
    "scalars": ("#scalars&_smoothingWeight=0&_ignoreYOutliers=false", "dashboard_scalars.png", 1100),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1.0)
    raise RuntimeError(f"TensorBoard did not answer at {url} within {timeout:.0f} s")


def screenshot(chromium: str, url: str, out: Path, *, width: int, height: int, wait_ms: int) -> None:
    """One headless Chromium screenshot of ``url`` after ``wait_ms`` of (virtual) page time."""
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                f"--virtual-time-budget={wait_ms}",
                f"--screenshot={out}",
                url,
            ],
            check=True,
            capture_output=True,
            timeout=180,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", help="an existing run (default: run the demo into a temporary folder)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "img"), help="where the PNGs go (default: docs/img)")
    parser.add_argument("--width", type=int, default=1600)
    parser.add_argument("--wait-ms", type=int, default=20000, help="page time before each screenshot")
    args = parser.parse_args(argv)

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("chromium not found; apt-get install -y chromium", file=sys.stderr)
        return 2
    temporary = None
    logdir = args.logdir
    if logdir is None:
        from hdi_monitor.contrib.demo import run_demo

        temporary = tempfile.mkdtemp(prefix="hdi-demo-")
        logdir = str(run_demo(temporary, progress=False))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    board = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorboard.main",
            "--logdir",
            logdir,
            "--port",
            str(port),
            "--bind_all=false",
            "--host",
            "127.0.0.1",
            "--reload_interval",
            "0",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    try:
        base = f"http://127.0.0.1:{port}/"
        _wait_for(base + "data/runs")
        time.sleep(3.0)  # the first load of the event files
        for fragment, name, height in TABS.values():
            screenshot(chromium, base + fragment, out / name, width=args.width, height=height, wait_ms=args.wait_ms)
            print(out / name)
    finally:
        board.terminate()
        board.wait(timeout=30)
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
