"""Regenerate the dashboard screenshots in docs/img/ from a demo run (not run in CI).

Runs `hdi-monitor demo` (or takes an existing run with ``--logdir``), starts TensorBoard on it,
and takes headless Chromium screenshots of the Custom Scalars, Images and Scalars tabs:

    PYTHONPATH=. python benchmarks/screenshots.py                 # the full demo, then screenshots
    PYTHONPATH=. python benchmarks/screenshots.py --logdir runs/demo/version_0
    PYTHONPATH=. python benchmarks/screenshots.py --depths 4 80 --out /tmp/pictures

``--depths`` takes the pictures at several depths instead: for each depth a synthetic run (the demo's
`CharLM`, D = 64, 8 heads, random weights with planted structure: in every fifth layer query head 1
drifts onto head 0, and one layer has a dead key head), 12 measured steps with images every 4th,
then screenshots of its Images tab (``images_<depth>_<tag>.png``, TensorBoard's default card size)
and of its HTML report (``report_<depth>.png``, from `hdi_monitor.cli.html.write_report`). For
looking at the pictures before and after a change; nothing goes to docs/img.

Needs the Debian package ``chromium`` (``apt-get install -y chromium``), TensorBoard and
``websocket-client`` (``pip install websocket-client``).
"""

from __future__ import annotations

import argparse
import base64
import json
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
#: tab -> (URL fragment, output file, window height).
TABS = {
    "custom_scalars": ("#custom_scalars&_smoothingWeight=0", "dashboard_custom_scalars.png", 1500),
    "diversity_map": ("#images&tagFilter=diversity_map%2Fkey", "dashboard_diversity_map.png", 700),
    "overlap": ("#images&tagFilter=%5Eoverlap%2Fkey%7C%5Ecorrelation", "dashboard_images.png", 1130),
    "scalars": ("#scalars&_smoothingWeight=0", "dashboard_scalars.png", 1100),
}
#: TensorBoard keeps "ignore outliers" in localStorage (a URL cannot set it): keep outliers in the
#: chart scaling, or a collapsing layer falls off its chart.
SETTINGS = "localStorage.setItem('_ignoreYOutliers', 'false');"
#: Tick a checkbox by its label, searching through the shadow roots of TensorBoard's web components.
CHECK = """(() => {
  const walk = (root) => {
    for (const el of root.querySelectorAll('*')) {
      if (el.tagName === 'PAPER-CHECKBOX' && el.textContent.includes(%s) && !el.checked) { el.click(); return true; }
      if (el.shadowRoot && walk(el.shadowRoot)) return true;
    }
    return false;
  };
  return walk(document);
})()"""


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


def _wait_for_run(base: str, timeout: float = 120.0) -> None:
    """Wait until TensorBoard has loaded a run (it loads the event files after it starts answering)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(base + "data/runs", timeout=5) as response:
            if json.loads(response.read()):
                time.sleep(2.0)
                return
        time.sleep(1.0)
    raise RuntimeError(f"TensorBoard found no run within {timeout:.0f} s")


class _Browser:
    """Headless Chromium driven over the DevTools protocol (``websocket-client``): TensorBoard
    keeps "ignore outliers" and smoothing in the page's localStorage, which a URL cannot set."""

    def __init__(self, chromium: str, *, width: int) -> None:
        import websocket

        self.profile = tempfile.mkdtemp(prefix="hdi-chromium-")
        port = _free_port()
        self.process = subprocess.Popen(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                f"--remote-debugging-port={port}",
                f"--user-data-dir={self.profile}",
                f"--window-size={width},1000",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as response:
                    pages = [t for t in json.loads(response.read()) if t["type"] == "page"]
                if pages:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.5)
        self.socket = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=120, suppress_origin=True)
        self.width = width
        self._id = 0

    def call(self, method: str, **params: object) -> dict:
        self._id += 1
        self.socket.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv())
            if message.get("id") == self._id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def open(self, url: str, *, height: int, wait_s: float) -> None:
        self.call(
            "Emulation.setDeviceMetricsOverride", width=self.width, height=height, deviceScaleFactor=1, mobile=False
        )
        self.call("Page.navigate", url=url)
        time.sleep(wait_s)

    def run(self, script: str) -> None:
        self.call("Runtime.evaluate", expression=script)

    def screenshot(self, out: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        out.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        self.socket.close()
        self.process.terminate()
        self.process.wait(timeout=30)
        shutil.rmtree(self.profile, ignore_errors=True)


#: Images-tab views of a ``--depths`` run: name -> URL fragment.
DEPTH_TABS = {
    "overlap_key": "#images&tagFilter=%5Eoverlap%2Fkey",
    "correlation": "#images&tagFilter=%5Ecorrelation",
    "diversity_map_query": "#images&tagFilter=%5Ediversity_map%2Fquery",
}


def _planted_run(depth: int, root: Path) -> tuple[Path, Path]:
    """A synthetic run of ``depth`` layers with visible structure (see the module docstring): the
    TensorBoard log folder and the HTML report's page."""
    import torch
    from torch.utils.tensorboard import SummaryWriter

    from hdi_monitor import head_diversity
    from hdi_monitor.cli.html import write_report
    from hdi_monitor.contrib.demo import CharLM
    from hdi_monitor.monitor.tracker import HDITracker

    torch.manual_seed(0)
    model = CharLM(d_model=64, num_heads=8, num_layers=depth, seq_len=32)
    d = 64 // 8
    layers = [layer.self_attn for layer in model.encoder.layers]
    with torch.no_grad():
        layers[depth // 2].in_proj_weight[64 + 3 * d : 64 + 4 * d] = 0.0  # a dead key head: NaN row and column
    log_dir = root / f"tb_{depth}"
    writer = SummaryWriter(str(log_dir))
    tracker = HDITracker(model, every_n_steps=1, log_images_every_n_steps=4, writer=writer, image_queue_size=8)
    tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    for _ in range(12):
        with torch.no_grad():  # query head 1 drifts onto head 0 in every fifth layer
            for attn in layers[::5]:
                w = attn.in_proj_weight
                w[d : 2 * d] = 0.7 * w[d : 2 * d] + 0.3 * w[:d]
        with tracker.capture(tokens):
            model(tokens)
        tracker.step()
    tracker.close()
    writer.close()
    files = write_report(head_diversity(model, inputs=tokens), root / f"report_{depth}", title=f"{depth} layers")
    return log_dir, files.html


def depth_screenshots(depths: list[int], out: Path, chromium: str, *, width: int, wait_s: float) -> None:
    """Screenshots of synthetic runs at each depth (see ``--depths``)."""
    root = Path(tempfile.mkdtemp(prefix="hdi-depths-"))
    try:
        for depth in depths:
            log_dir, page = _planted_run(depth, root)
            height = 1400
            shot = out / f"report_{depth}.png"
            subprocess.run(
                [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                 f"--window-size={width},{height}", f"--screenshot={shot}", page.as_uri()],
                check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120,
            )  # fmt: skip
            print(shot)
            port = _free_port()
            board = subprocess.Popen(
                [sys.executable, "-m", "tensorboard.main", "--logdir", str(log_dir), "--port", str(port),
                 "--host", "127.0.0.1", "--reload_interval", "0"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
            )  # fmt: skip
            try:
                base = f"http://127.0.0.1:{port}/"
                _wait_for(base + "data/runs")
                _wait_for_run(base)
                browser = _Browser(chromium, width=width)
                try:
                    for name, fragment in DEPTH_TABS.items():
                        browser.open(base + fragment, height=height, wait_s=wait_s)
                        browser.screenshot(out / f"images_{depth}_{name}.png")
                        print(out / f"images_{depth}_{name}.png")
                finally:
                    browser.close()
            finally:
                board.terminate()
                board.wait(timeout=30)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", help="an existing run (default: run the demo into a temporary folder)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "img"), help="where the PNGs go (default: docs/img)")
    parser.add_argument("--width", type=int, default=1600)
    parser.add_argument("--wait-s", type=float, default=12.0, help="seconds to let each tab draw")
    parser.add_argument("--depths", type=int, nargs="+", help="synthetic runs at these depths instead of the demo")
    args = parser.parse_args(argv)

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("chromium not found; apt-get install -y chromium", file=sys.stderr)
        return 2
    if args.depths:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        depth_screenshots(args.depths, out, chromium, width=args.width, wait_s=args.wait_s)
        return 0
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
        _wait_for_run(base)
        browser = _Browser(chromium, width=args.width)
        try:
            browser.open(base, height=800, wait_s=3.0)  # same origin: its localStorage is TensorBoard's
            browser.run(SETTINGS)
            for fragment, name, height in TABS.values():
                browser.open(base + fragment, height=height, wait_s=args.wait_s)
                if fragment.startswith("#images"):  # draw the PNGs at their own size, not shrunk to a card
                    browser.run(CHECK % json.dumps("Show actual image size"))
                    time.sleep(3.0)
                browser.screenshot(out / name)
                print(out / name)
        finally:
            browser.close()
    finally:
        board.terminate()
        board.wait(timeout=30)
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
