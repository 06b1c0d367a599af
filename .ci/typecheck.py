"""mypy over the installed package layout: shoal's card folders (aggregation/, client/, ...)
install as subpackages of ``shoal`` (pyproject's package-dir), which mypy cannot map from
the source tree, so this builds that layout from symlinks in .mypy_tree/ and checks it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("aggregation", "client", "server", "p2p", "simulations", "flower")


def main() -> int:
    tree = REPO / ".mypy_tree"
    shutil.rmtree(tree, ignore_errors=True)
    pkg = tree / "shoal"
    pkg.mkdir(parents=True)
    for item in (REPO / "shoal").iterdir():
        if item.name != "__pycache__":
            (pkg / item.name).symlink_to(item)
    for name in SUBPACKAGES:
        (pkg / name).symlink_to(REPO / name, target_is_directory=True)
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"), str(pkg)]
    return subprocess.call(cmd, cwd=tree)


if __name__ == "__main__":
    sys.exit(main())
