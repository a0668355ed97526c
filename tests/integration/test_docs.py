"""Every code block of README.md and docs/ runs as written (on tiny models), or says why not.

A fenced `python` or `bash` block must follow a marker comment (invisible on GitHub and on the
site):

    <!-- docs-test -->                                  run it as written
    <!-- docs-test: {"replace": [["max_steps=300", "max_steps=4"]]} -->
                                                        run it with these exact substitutions
                                                        (each one must occur in the block), to
                                                        make a long run short or a model tiny
    <!-- docs-test: {"expect": ["0.923"]} -->           the output must contain these strings
    <!-- docs-test: {"check": "trainer.global_step == 4"} -->
                                                        a Python expression, true after the block
    <!-- docs-test: {"slow": true} -->                  runs in the slow set
    <!-- docs-test: {"skip": "needs 8 GPUs"} -->        not run; the reason is shown in the docs source

The blocks of one page run in order, in one temporary directory (holding copies of the project's
`configs/`, `docs/`, `examples/` and `benchmarks/`, so that a script writing its default results
path writes into the copy) and, for Python, one namespace. A test fails if running a page changed
any file of those four folders in the repository. Shell blocks run under `bash -euo pipefail` with
this Python's `bin/` first on PATH. Output blocks are fenced as `text` and are not run.

The fast set runs every page's blocks that are not marked slow; the slow set runs, in full, each
page that has a slow block. So a block that needs the result of a slow one is marked slow too.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import read_events, scalar_series

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUN_LANGS = {"python", "bash"}
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>[^\n`]*)$")
MARKER = re.compile(r"^\s*<!--\s*docs-test(?::\s*(?P<opts>.*?))?\s*-->\s*$", re.DOTALL)
OPTIONS = {"replace", "expect", "check", "slow", "skip"}


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    code: str
    options: dict | None  # None: no marker

    @property
    def opts(self) -> dict:
        """The marker's options ({} without a marker)."""
        return self.options or {}

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def extract_blocks(page: Path) -> list[Block]:
    """Fenced code blocks of a Markdown page, with the docs-test marker just above each (if any)."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m["indent"]), m["fence"], m["info"].strip().split(" ")[0].lower()
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        k = i - 1  # the marker: the nearest non-blank line above, possibly a multi-line comment
        while k >= 0 and not lines[k].strip():
            k -= 1
        options = None
        if k >= 0 and lines[k].strip().endswith("-->"):
            start = k
            while start > 0 and "<!--" not in lines[start]:
                start -= 1
            mm = MARKER.match("\n".join(lines[start : k + 1]))
            if mm:
                options = json.loads(mm["opts"]) if mm["opts"] else {}
        blocks.append(Block(page, i + 1, lang, "\n".join(body) + "\n", options))
        i = j + 1
    return blocks


ALL_BLOCKS = [b for page in PAGES for b in extract_blocks(page)]


def _runnable(page: Path, slow: bool) -> list[Block]:
    """The blocks of `page` that run: in the slow set all of a page with a slow block, else the fast ones."""
    blocks = [
        b
        for b in ALL_BLOCKS
        if b.page == page and b.lang in RUN_LANGS and b.options is not None and "skip" not in b.options
    ]
    if slow:
        return blocks if any(b.opts.get("slow", False) for b in blocks) else []
    return [b for b in blocks if not b.opts.get("slow", False)]


def _pages_to_run(slow: bool) -> list[Path]:
    return [page for page in PAGES if _runnable(page, slow)]


def test_every_code_block_is_marked():
    assert len(PAGES) > 10 and len(ALL_BLOCKS) > 20, "the extractor found too few pages or blocks"
    unmarked = [b.where for b in ALL_BLOCKS if b.lang in RUN_LANGS and b.options is None]
    assert not unmarked, f"python/bash blocks without a docs-test marker (run it or say why not): {unmarked}"
    unknown = [b.where for b in ALL_BLOCKS if b.lang not in RUN_LANGS | {"text", "yaml", "csv", "mermaid"}]
    assert not unknown, (
        f"blocks in a language the docs test does not know (use python, bash, text or mermaid): {unknown}"
    )
    for b in ALL_BLOCKS:
        if b.options is not None:
            assert set(b.options) <= OPTIONS, f"{b.where}: unknown docs-test options {set(b.options) - OPTIONS}"
            assert b.lang in RUN_LANGS, f"{b.where}: a docs-test marker on a {b.lang!r} block"
            if "skip" in b.options:
                assert isinstance(b.options["skip"], str) and len(b.options["skip"]) > 10, f"{b.where}: say why"


def test_marker_parser_reads_options_and_fences(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        'text\n\n<!-- docs-test: {"replace": [["a", "b"]],\n "slow": true} -->\n```python\nx = 1\n```\n\n'
        "```text\nout\n```\n\n- item\n\n    <!-- docs-test -->\n    ```bash\n    echo hi\n    ```\n"
    )
    blocks = extract_blocks(page)
    assert [(b.lang, b.code, b.options) for b in blocks] == [
        ("python", "x = 1\n", {"replace": [["a", "b"]], "slow": True}),
        ("text", "out\n", None),
        ("bash", "echo hi\n", {}),
    ]


def _prepared(block: Block) -> str:
    code = block.code
    for old, new in block.opts.get("replace", []):
        assert old in code, f"{block.where}: the substitution {old!r} no longer matches the block"
        code = code.replace(old, new)
    return code


COPIED = ("configs", "docs", "examples", "benchmarks")


def _tree_state() -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file under the copied folders of the repository."""
    state = {}
    for name in COPIED:
        for path in (ROOT / name).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                st = path.stat()
                state[str(path.relative_to(ROOT))] = (st.st_size, st.st_mtime_ns)
    return state


def _run_page(page: Path, tmp_path: Path, monkeypatch, slow: bool) -> None:
    before = _tree_state()
    try:
        _run_blocks(page, tmp_path, monkeypatch, slow)
    finally:
        after = _tree_state()
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        assert not changed, (
            f"running {page.relative_to(ROOT)} wrote into the repository (write into the temporary directory): {changed}"
        )


def _run_blocks(page: Path, tmp_path: Path, monkeypatch, slow: bool) -> None:
    for name in COPIED:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.chdir(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    namespace: dict = {"__name__": "__docs__", "read_events": read_events, "scalar_series": scalar_series}
    for block in _runnable(page, slow):
        code = _prepared(block)
        if block.lang == "python":
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(code, block.where, "exec"), namespace)  # noqa: S102 - the docs' own code
            text = out.getvalue()
        else:
            proc = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", code],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
            assert proc.returncode == 0, f"{block.where} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
            text = proc.stdout + proc.stderr
        for expected in block.opts.get("expect", []):
            assert expected in text, f"{block.where}: {expected!r} not in the output:\n{text[-3000:]}"
        if "check" in block.opts:
            assert eval(block.opts["check"], namespace), f"{block.where}: {block.opts['check']} is false"


def _quick_pages() -> list:
    """The pages of the quick set; a page with a shell block (a subprocess) goes to the slow set."""
    params = []
    for page in _pages_to_run(slow=False):
        shell = any(
            b.page == page and b.lang == "bash" and b.options is not None and "skip" not in b.options
            for b in ALL_BLOCKS
        )
        params.append(pytest.param(page, marks=pytest.mark.slow) if shell else page)
    return params


@pytest.mark.parametrize("page", _quick_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_page_blocks_run(page, tmp_path, monkeypatch):
    _run_page(page, tmp_path, monkeypatch, slow=False)


@pytest.mark.slow
@pytest.mark.parametrize("page", _pages_to_run(slow=True), ids=lambda p: str(p.relative_to(ROOT)))
def test_page_blocks_run_slow(page, tmp_path, monkeypatch):
    _run_page(page, tmp_path, monkeypatch, slow=True)


FIGURES = re.compile(r"<!--\s*figures:\s*(?P<json>\{.*?\})\s*-->", re.DOTALL)


def _words(text: str) -> str:
    return " ".join(text.replace("**", "").split())


def test_quoted_figures_match_their_results_files():
    """A `<!-- figures: {"results file": ["figure", ...]} -->` marker on a page lists figures that the
    page quotes from a file that a script wrote: each must be in both (so a re-run that changes a
    figure fails here until the page is updated)."""
    markers = [(page, json.loads(m["json"])) for page in PAGES for m in FIGURES.finditer(page.read_text())]
    assert any(page.name == "README.md" for page, _ in markers), "the README quotes no results file"
    for page, sources in markers:
        page_text = _words(FIGURES.sub("", page.read_text()))
        for source, figures in sources.items():
            source_text = _words((ROOT / source).read_text())
            for figure in figures:
                assert figure in source_text, (
                    f"{page.relative_to(ROOT)}: {figure!r} is not in {source} (re-run changed it?)"
                )
                assert figure in page_text, f"{page.relative_to(ROOT)} does not quote {figure!r} from {source}"


def test_every_test_the_robustness_page_cites_exists():
    """docs/robustness.md backs each guarantee with tests named `test_x` or `file.py::test_x`: each
    is a test function of tests/ (of that file when one is named), read from the test files' syntax
    trees, so a renamed or removed test cannot leave a guarantee citing nothing."""
    import ast

    defined: dict[str, set[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                defined.setdefault(node.name, set()).add(path.name)
    text = (ROOT / "docs" / "robustness.md").read_text()
    cited = re.findall(r"`(?:([\w/]+\.py)::)?(test_\w+)(?:\[[^\]`]*\])?`", text)
    assert len(cited) >= 30
    missing = [f"{file}::{name}" if file else name for file, name in cited if not defined.get(name)]
    misplaced = [f"{file}::{name}" for file, name in cited if file and Path(file).name not in defined.get(name, ())]
    assert (missing, misplaced) == ([], [])


def test_readme_quick_start_is_a_real_run(tmp_path, monkeypatch):
    """The README's Quick start, shortened only by its marker, logs HDI points on the loss's step axis."""
    quick = next(b for b in extract_blocks(ROOT / "README.md") if b.lang == "python")
    assert "HDIMonitor" in quick.code and "TensorBoardLogger" in quick.code
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    exec(compile(_prepared(quick), quick.where, "exec"), namespace)  # noqa: S102
    trainer = namespace["trainer"]
    (monitor,) = [c for c in trainer.callbacks if type(c).__name__ == "HDIMonitor"]
    assert trainer.global_step > monitor.config.every_n_steps  # at least two measurements
    series = scalar_series(read_events(tmp_path / "runs"), "hdi/key/mean")
    assert sorted(series) == list(range(0, trainer.global_step, monitor.config.every_n_steps))
    assert all(0.0 < v <= 1.0 for v in series.values())
