"""The package layout's rules, read from the source (ast), not from what is loaded:
no import cycle between jlco modules (counting imports inside functions too), each
package imports only the packages its row of ALLOWED names (so no package-level cycle
either), the scheduler imports no jax, every package says in its docstring what lives
there, and nothing in the repository cites files outside it."""

import ast
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
JLCO = ROOT / "jlco"

# Which jlco packages each jlco package may import, anywhere in its body (the layering
# the package docstrings state). A module file at the top (jlco/config.py, the entry
# points jlco/serve.py, ...) is a package of its own name; "jlco" is jlco/__init__.py.
ALLOWED = {
    # the bottom: the standard library, jax / numpy, nothing of jlco
    "jlco": set(),
    "util": set(),
    "config": set(),
    "native": set(),
    "pallas": {"native"},
    "offload": {"util"},
    # the mesh sits below the model, whose MoE block runs expert-parallel on it
    "parallel": {"config"},
    "model": {"config", "native", "offload", "pallas", "parallel", "util"},
    "checkpoint": {"config", "model", "util"},
    "planning": {"config", "model", "util"},
    # a request's sampling parameters and the draw inside the step
    "sampling": {"util"},
    "engine": {"config", "model", "native", "offload", "pallas", "parallel", "planning",
               "sampling", "util"},
    # chat formats as text functions (encoders, output parsers): the standard library only
    "chat": set(),
    # structured outputs: grammars as the engine's token constraints
    "structured": {"sampling"},
    "server": {"chat", "config", "engine", "model", "sampling", "structured", "util"},
    # operators' HTTP clients: they talk to a server, never load a model
    "ops": {"config", "util"},
    # the load sequence generate and serve share: model choice, mesh, weights
    "launch": {"checkpoint", "config", "parallel", "planning"},
    # entry points (`python -m jlco.X`)
    "convert": {"checkpoint", "config", "util"},
    "diagnose": {"ops", "planning", "util"},
    "generate": {"config", "engine", "launch", "parallel", "planning", "sampling", "util"},
    "plan": {"config", "planning", "util"},
    "serve": {"config", "engine", "launch", "model", "parallel", "planning", "server",
              "util"},
    "sim": {"config", "planning", "util"},
    "validate": {"config", "launch", "ops", "util"},
}


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


def _package(module: str) -> str:
    """jlco.model.mla -> "model", jlco.serve -> "serve", jlco -> "jlco"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _cross_package_imports() -> list[tuple[str, str]]:
    """(importer, imported) module pairs of different jlco packages."""
    return sorted((m, d) for m, deps in _graph().items() for d in deps
                  if _package(m) != _package(d))


def _package_graph() -> dict[str, set[str]]:
    graph = {_package(m): set() for m in _modules()}
    for m, d in _cross_package_imports():
        graph[_package(m)].add(_package(d))
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components: any component of size > 1 is a cycle."""
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
    return cycles


def test_no_import_cycles():
    graph = _graph()
    assert "jlco.engine.runner" in graph and "jlco.planning.memory" in graph
    assert _cycles(graph) == []


def test_every_package_has_a_row_in_the_table():
    packages = set(_package_graph())
    assert {"jlco", "config", "model", "engine", "serve"} <= packages
    assert packages - set(ALLOWED) == set(), "give each new package its row in ALLOWED"
    assert set().union(*ALLOWED.values()) <= set(ALLOWED)


def test_imports_follow_the_table():
    wrong = [f"{m} -> {d}" for m, d in _cross_package_imports()
             if _package(d) not in ALLOWED[_package(m)]]
    assert wrong == [], "imports against ALLOWED (move the code, or change the layering " \
                        "in ALLOWED and the package docstring together):\n" + "\n".join(wrong)


def test_no_package_level_cycles():
    assert _cycles(_package_graph()) == []
    assert _cycles(ALLOWED) == []     # the table itself is a layering


def test_cycle_detector_sees_a_cycle(tmp_path):
    """The import reader must see function-level imports (how plan and sim were tied)."""
    a = tmp_path / "a.py"
    a.write_text("def f():\n    from jlco.planning import memory\n")
    assert _imports(a, {"jlco.planning.memory", "jlco.planning"}) == {"jlco.planning.memory"}


def test_package_cycle_detector_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The scheduler and its plain-Python request checks (the sampling parameters).
PLAIN_ENGINE = ("engine.scheduler", "sampling.errors", "sampling.params", "sampling.penalties")


@pytest.mark.parametrize("module", PLAIN_ENGINE)
def test_scheduler_imports_no_jax_in_source(module):
    tree = ast.parse((JLCO / f"{module.replace('.', '/')}.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    plain = {f"jlco.{m}" for m in PLAIN_ENGINE}
    assert not any(n == "jax" or n.startswith(("jax.", "flax", "jlco.model"))
                   or (n.startswith(("jlco.engine.", "jlco.sampling.")) and n not in plain)
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


MAX_CLASS_LINES, MAX_FUNCTION_LINES = 250, 80


def _oversized(path: pathlib.Path) -> list[str]:
    out = []
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    for node in ast.walk(ast.parse(path.read_text())):
        lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
        if isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
            out.append(f"{name}: class {node.name} has {lines} lines")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                and lines > MAX_FUNCTION_LINES:
            out.append(f"{name}: {node.name}() has {lines} lines")
    return out


def test_no_class_or_function_is_too_long():
    """Classes stay under 250 lines and functions under 80 (a reader holds one at once)."""
    assert [m for p in sorted(JLCO.rglob("*.py")) for m in _oversized(p)] == []


def test_size_check_sees_a_long_function(tmp_path):
    f = tmp_path / "probe.py"
    f.write_text("def f():\n" + "    x = 1\n" * 90)
    assert _oversized(f) == ["probe.py: f() has 91 lines"]
