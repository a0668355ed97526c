"""List the test files that the placement rule of ``tests/README.md`` does not place.

Run from the repository root::

    python -m tests.helpers.placement          # exit 1 and one line per misplaced file, 0 when all are placed
    python -m tests.helpers.placement --names  # also unit files named for no module of their package

The rule: a test file (``test_*.py``) lives in ``tests/unit/<package>/`` (``<package>`` a subpackage of
``hdi_monitor``; ``tests/unit/`` itself for the top-level modules), ``tests/integration/`` or
``tests/distributed/``. For a misplaced file the line suggests a folder: the ``hdi_monitor`` subpackage its
imports name most, or ``tests/distributed/`` when it uses the gloo rank pools (``gloo2``/``gloo4``).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
PACKAGE = ROOT / "hdi_monitor"
TIER_FOLDERS = ("integration", "distributed")


def subpackages() -> set[str]:
    """The subpackages of ``hdi_monitor`` (folders holding an ``__init__.py``)."""
    return {p.parent.name for p in PACKAGE.glob("*/__init__.py")}


def modules(package: str | None) -> set[str]:
    """Module names (without a leading underscore) of ``hdi_monitor.<package>``, or of ``hdi_monitor`` itself."""
    folder = PACKAGE / package if package else PACKAGE
    names = {p.stem.lstrip("_") for p in folder.glob("*.py") if p.stem != "__init__"}
    names |= {p.parent.name for p in folder.glob("*/__init__.py")}
    return names


def placed(path: Path, packages: set[str]) -> bool:
    """Whether ``path`` (a test file) sits where the rule puts test files."""
    parts = path.relative_to(TESTS).parts
    if len(parts) == 2 and parts[0] in TIER_FOLDERS:
        return True
    if parts[0] != "unit":
        return False
    return len(parts) == 2 or (len(parts) == 3 and parts[1] in packages)


def suggest(path: Path, packages: set[str]) -> str:
    """A folder for a misplaced test file, from what it imports and the fixtures it names."""
    text = path.read_text(encoding="utf-8")
    if "gloo2" in text or "gloo4" in text:
        return "tests/distributed/"
    counts: Counter[str] = Counter()
    for node in ast.walk(ast.parse(text)):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "hdi_monitor" and len(parts) > 1 and parts[1] in packages:
                counts[parts[1]] += 1
    if not counts:
        return "tests/unit/ or tests/integration/"
    return f"tests/unit/{counts.most_common(1)[0][0]}/ (or tests/integration/ if it trains end to end)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", action="store_true", help="also list unit files named for no module")
    args = parser.parse_args(argv)
    packages = subpackages()
    files = sorted(p for p in TESTS.rglob("test_*.py") if "scripts" not in p.relative_to(TESTS).parts)
    misplaced = [p for p in files if not placed(p, packages)]
    for p in misplaced:
        print(f"{p.relative_to(ROOT)}: not placed by the rule; move it to {suggest(p, packages)}")
    if args.names:
        for p in files:
            parts = p.relative_to(TESTS).parts
            if p in misplaced or parts[0] != "unit":
                continue
            package = parts[1] if len(parts) == 3 else None
            if p.stem.removeprefix("test_") not in modules(package):
                where = f"hdi_monitor.{package}" if package else "hdi_monitor"
                print(f"{p.relative_to(ROOT)}: named for no module of {where} (fine if it covers several)")
    if not misplaced:
        print(f"all {len(files)} test files are placed by the rule (tests/README.md)", file=sys.stderr)
    return 1 if misplaced else 0


if __name__ == "__main__":
    sys.exit(main())
