"""What each job imports: the core (simulate, server, client, peer) needs neither Flower nor Ray,
which come with the optional extra ``shoal[flower]``."""

from __future__ import annotations

import subprocess
import sys

import pytest

CORE_MODULES = [
    "shoal.cli",
    "shoal.server.app",
    "shoal.server.cli",
    "shoal.client.node",
    "shoal.client.cli",
    "shoal.p2p.peer",
    "shoal.p2p.cli",
    "shoal.simulations.experiment",
    "shoal.simulations.privacy_sweep",
    "shoal.simulations.gossip",
    "shoal.simulations.virtual_run",
]


DEPLOYED_MODULES = [
    "shoal.server.app",
    "shoal.server.cli",
    "shoal.client.node",
    "shoal.client.cli",
    "shoal.p2p.peer",
    "shoal.p2p.cli",
]


@pytest.mark.slow
def test_what_each_job_imports_in_a_fresh_interpreter(tmp_path):
    """One fresh interpreter (each start costs seconds) checks, in this order: a backend chosen
    before shoal is imported stays chosen; the deployed server, client and peer import nothing
    from the simulator; the core jobs import neither Flower nor Ray; drawing a report's curves
    leaves the backend as it was."""
    code = (
        "import importlib, sys\n"
        "import matplotlib\nmatplotlib.use('svg')\n"
        f"for m in {DEPLOYED_MODULES!r}: importlib.import_module(m)\n"
        "print('simulator:' + ','.join(sorted(m for m in sys.modules if m.startswith('shoal.simulations'))))\n"
        f"for m in {CORE_MODULES!r}: importlib.import_module(m)\n"
        "print('extras:' + ','.join(sorted(m for m in sys.modules if m.split('.')[0] in ('flwr', 'ray'))))\n"
        "import shoal.simulations.experiment, shoal.simulations.privacy_sweep, shoal.simulations.report as r\n"
        "assert matplotlib.get_backend() == 'svg', matplotlib.get_backend()\n"
        "recs = [{'round': 1, 'test_accuracy': 0.5}, {'round': 2, 'test_accuracy': 0.6}]\n"
        f"r.plot_curves(recs, {str(tmp_path)!r})\n"
        "assert matplotlib.get_backend() == 'svg', matplotlib.get_backend()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(":", 1) for line in out.stdout.splitlines() if ":" in line)
    assert lines.get("simulator") == "", f"the deployed jobs imported: {lines.get('simulator')}"
    assert lines.get("extras") == "", f"the core jobs imported: {lines.get('extras')}"
    assert (tmp_path / "accuracy.png").stat().st_size > 1000


def _module_graph():
    """shoal's modules (card folders mapped as the install maps them), their module-level shoal imports,
    and every private name imported from another module."""
    import ast
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    folders = {
        "shoal": "shoal",
        "aggregation": "shoal.aggregation",
        "client": "shoal.client",
        "server": "shoal.server",
        "p2p": "shoal.p2p",
        "simulations": "shoal.simulations",
        "flower": "shoal.flower",
    }
    mods = {}
    for folder, pkg in folders.items():
        for f in (repo / folder).glob("*.py"):
            mods[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    for folder, base in folders.items():  # subpackages: shoal/config/, aggregation/secagg/, simulations/gossip/
        for f in (repo / folder).glob("*/*.py"):
            pkg = f"{base}.{f.parent.name}"
            mods[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    graph, private = {}, []
    for name, f in mods.items():
        pkg = name if f.stem == "__init__" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.parse(f.read_text()).body:  # module level: lazy imports in functions are deliberate
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if not target.startswith("shoal"):
                    continue
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    deps.add(full if full in mods else target)
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        private.append(f"{name} imports {target}.{alias.name}")
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("shoal"))
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph, private


def test_no_import_cycle_and_no_private_name_across_modules():
    graph, private = _module_graph()
    assert len(graph) > 80
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(u: str, stack: list[str]) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                cycles.append(stack[stack.index(v) :] + [v])
            elif not state.get(v):
                visit(v, stack)
        stack.pop()
        state[u] = 2

    for m in sorted(graph):
        if not state.get(m):
            visit(m, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
    assert not private, "private names imported across modules: " + "; ".join(private)


def test_every_package_folder_is_listed_for_installation():
    """A non-editable `pip install .` ships only the packages pyproject lists: a new subpackage
    (shoal/config/, ...) missing there would work in the dev venv and break on an edge node."""
    import tomllib
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    tool = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    folders = {pkg: repo / folder for pkg, folder in tool["package-dir"].items()}
    found = set()
    for pkg, folder in folders.items():
        found.add(pkg)
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder)
            if rel.parts and "__pycache__" not in rel.parts:
                found.add(".".join([pkg, *rel.parts]))
    assert found - listed == set(), f"packages not listed in pyproject: {sorted(found - listed)}"
