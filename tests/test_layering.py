"""The house's layering, read from the source (every import, the ones inside functions included):

- the core (accelbatch/, outside the factory ``build`` and the command line ``cli``) imports no backend and no
  torch.distributed: worlds, agents, teachers and the data side know no device;
- no import cycle among the package's modules (``accelbatch.backends`` included);
- no module over 500 lines.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FACTORY_AND_CLI = {"accelbatch.build", "accelbatch.cli"}


def _modules() -> dict[str, pathlib.Path]:
    """Module name -> file, for accelbatch/ and backends/ (installed as accelbatch.backends)."""
    out = {}
    for folder, package in ((ROOT / "accelbatch", "accelbatch"), (ROOT / "backends", "accelbatch.backends")):
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """Every module ``name`` imports, anywhere in the file (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in _imports(name, path) if m in modules and m != name}
    return graph


def test_the_core_imports_no_backend_and_no_torch_distributed():
    offenders = []
    for name, path in _modules().items():
        if name.startswith("accelbatch.backends") or name in FACTORY_AND_CLI:
            continue
        for imported in _imports(name, path):
            if imported.startswith("accelbatch.backends") or imported.startswith("torch.distributed"):
                offenders.append(f"{name} imports {imported}")
    assert not offenders, "\n".join(sorted(offenders))


def test_no_import_cycle_among_the_package_modules():
    graph = _graph()
    # a package's __init__ re-exporting its modules is not a cycle of the modules themselves
    edges = {name: {m for m in deps if not (name.startswith(m + ".") and m in graph)} for name, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_package_loads_its_names_on_first_use_and_run_stays_the_function():
    """``import accelbatch`` imports no torch (the command line's entry point runs first); ``ab.run`` is the
    function whether or not the module ``accelbatch.run`` was imported before (its import names the module on
    the package)."""
    code = ("import sys\n"
            "import accelbatch as ab\n"
            "assert 'torch' not in sys.modules, 'torch imported by the package'\n"
            "import accelbatch.run\n"
            "from accelbatch.run import evaluate\n"
            "assert ab.run.__module__ == 'accelbatch.run' and callable(ab.run), ab.run\n"
            "from accelbatch import Opts, run, format_report\n"
            "assert run is ab.run and Opts.__name__ == 'Opts' and callable(format_report)\n"
            "assert set(ab.__all__) <= set(dir(ab))\n"
            "print('ok')\n")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert ran.stdout == "ok\n", ran.stderr


def test_no_module_of_the_product_is_over_500_lines():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > 500}
    assert not long, f"split these modules by job: {long}"
