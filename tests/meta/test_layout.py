"""The package layout's rules, read from the source (ast), not from what is loaded:
no import cycle between jlco modules (counting imports inside functions too), the
scheduler imports no jax, every package says in its docstring what lives there, and
nothing in the repository cites files outside it."""

import ast
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
JLCO = ROOT / "jlco"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in JLCO.rglob("*.py")}


def _imports(path: pathlib.Path, known: set[str]) -> set[str]:
    """jlco modules `path` imports anywhere in its body (a `from pkg import name` whose
    name is a submodule counts as importing that submodule)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in known:
                    out.add(sub)
                elif node.module in known:
                    out.add(node.module)
    return out


def _graph():
    mods = _modules()
    return {m: _imports(p, set(mods)) - {m} for m, p in mods.items()}


def test_no_import_cycles():
    graph = _graph()
    assert "jlco.engine.runner" in graph and "jlco.planning.memory" in graph
    # Tarjan's strongly connected components: any component of size > 1 is a cycle.
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []


def test_cycle_detector_sees_a_cycle(tmp_path):
    """The import reader must see function-level imports (how plan and sim were tied)."""
    a = tmp_path / "a.py"
    a.write_text("def f():\n    from jlco.planning import memory\n")
    assert _imports(a, {"jlco.planning.memory", "jlco.planning"}) == {"jlco.planning.memory"}


def test_scheduler_imports_no_jax_in_source():
    tree = ast.parse((JLCO / "engine" / "scheduler.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(n == "jax" or n.startswith(("jax.", "flax", "jlco.model", "jlco.engine."))
                   for n in names), names


@pytest.mark.parametrize("pkg", sorted(p.parent.name for p in JLCO.glob("*/__init__.py")))
def test_every_package_has_a_docstring(pkg):
    doc = ast.get_docstring(ast.parse((JLCO / pkg / "__init__.py").read_text()))
    assert doc and len(doc.split()) >= 20, f"jlco/{pkg}/__init__.py needs a docstring"
    assert "import" in doc, f"jlco/{pkg}: say what the package may import"


def test_nothing_cites_files_outside_the_repository():
    # The patterns are built from pieces so this file does not match itself.
    outside = ("../" + "shared", "shared" + "/design")
    out = subprocess.run(["git", "grep", "-n", "-e", outside[0], "-e", outside[1]],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.stdout == "", out.stdout
