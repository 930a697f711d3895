"""The package graph: imports point one way (pyproject.toml's import-linter layers contract:
entrypoints, benchmark, engine, pipeline, spec_decode, model_executor, distributed | weights, ops)
and no module is on an import circle. Lazy imports inside functions count too."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), or modules importing themselves."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.find_modules_directly_imported_by(v):
                out.append(sorted(comp))

    for m in sorted(graph.modules):
        if m not in index:
            visit(m)
    return out


def test_imports_point_one_way():
    from importlinter.cli import lint_imports

    assert lint_imports(config_filename=str(ROOT / "pyproject.toml")) == 0  # its report names the upward import


def test_no_import_circle():
    import grimp

    graph = grimp.build_graph("swiftspec")
    assert len(graph.modules) > 50
    assert _cycles(graph) == []


def test_the_package_picture_is_the_code():
    """docs/packages.md's graph lists exactly the imports between packages the code has."""
    import re

    import grimp

    graph = grimp.build_graph("swiftspec")
    edges = set()
    for m in graph.modules:
        for d in graph.find_modules_directly_imported_by(m):
            a, b = (x.split(".")[1] if x.count(".") else None for x in (m, d))
            if a and b and a != b and a != "__main__":
                edges.add((a, b))
    drawn = set(re.findall(r"^    (\w+) --> (\w+)$", (ROOT / "docs" / "packages.md").read_text(), re.M))
    assert drawn == edges, f"update docs/packages.md: missing {edges - drawn}, gone {drawn - edges}"
