"""Fail when the source has an import cycle or imports another module's private name.

Every ``import`` statement counts, deferred ones (inside functions) and ``TYPE_CHECKING`` blocks
included: a cycle hidden behind a function-level import is still a cycle a reader has to untangle.
A private name is one that starts with a single underscore; importing it from another module means
the two modules share something that should be public in one of them.

Run: ``python .ci/import_check.py`` (exit 1 and a list of findings when there are any).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("aggregation", "client", "flower", "p2p", "server", "shoal", "simulations")


def module_files() -> dict[str, Path]:
    """Map each dotted module name of the project to its file."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[0] != "shoal":  # the card folders install as subpackages of shoal
                parts.insert(0, "shoal")
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def resolve(name: str, level: int, here: str, is_package: bool) -> str:
    """The absolute dotted name of an import written relative to module ``here``."""
    if level == 0:
        return name
    base = here.split(".") if is_package else here.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, name] if name else base)


def scan(modules: dict[str, Path]) -> tuple[dict[str, set[str]], list[str]]:
    """The import graph between project modules, and the private names imported across them."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    private: list[str] = []
    for here, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules and alias.name != here:
                        graph[here].add(alias.name)
            elif isinstance(node, ast.ImportFrom):
                source = resolve(node.module or "", node.level, here, is_package)
                if source not in modules:
                    continue
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    if sub in modules:  # `from package import module`
                        if sub != here:
                            graph[here].add(sub)
                        continue
                    if source != here:
                        graph[here].add(source)
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        rel = path.relative_to(ROOT)
                        private.append(f"{rel}:{node.lineno}: imports private {source}.{alias.name}")
    return graph, private


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, todo = work[-1]
            if todo:
                nxt = todo.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def shortest_loop(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One short loop through the component, to show where to cut."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(graph[node] & members):
                if nxt == start:
                    loop = [node]
                    while loop[-1] != start:
                        loop.append(previous[loop[-1]])
                    return [start, *reversed(loop[:-1]), start]
                if nxt not in previous:
                    previous[nxt] = node
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    return component


def main() -> int:
    graph, private = scan(module_files())
    found = cycles(graph)
    for component in found:
        print(f"import cycle among {len(component)} modules: {', '.join(component)}")
        print(f"  e.g. {' -> '.join(shortest_loop(graph, component))}")
    for line in private:
        print(line)
    if found or private:
        print(f"{len(found)} import cycle(s), {len(private)} private import(s)")
        return 1
    print("no import cycle, no private name imported across modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
