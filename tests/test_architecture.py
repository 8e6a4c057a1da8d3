"""The shape of the code (docs/architecture.md): no import cycle between lmrepo's
modules, the library never imports the benchmarks, and lmrepo's own validation has no
hand-written type checks (the schema's types do that)."""

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "lmrepo"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """lmrepo modules imported at module level (imports inside functions are deferred on purpose)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name.startswith("lmrepo")}


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}


def test_no_import_cycles():
    edges, cycles = graph(), []

    def visit(node, stack, done):
        if node in stack:
            cycles.append(stack[stack.index(node) :] + [node])
            return
        if node in done:
            return
        for nxt in edges[node]:
            # a package's __init__ importing its own submodules is not a cycle
            if not nxt.startswith(node + "."):
                visit(nxt, stack + [node], done)
        done.add(node)

    done = set()
    for module in sorted(edges):
        visit(module, [], done)
    assert cycles == [], cycles[:3]


def test_the_library_never_imports_benchmarks_or_tests():
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not {n for n in names if n.split(".")[0] in ("benchmarks", "common", "tests", "conftest")}, path


def test_config_rules_check_ranges_not_types():
    """Type checks of values belong to OmegaConf's structured schema, not to lmrepo's rules: the
    components' modules hold no isinstance at all (messages.py and reference.py read errors and
    type annotations, not values)."""
    for path in (PACKAGE / "config").glob("*.py"):
        if path.name not in ("messages.py", "reference.py"):
            assert "isinstance(" not in path.read_text(), path
