"""The shape of the code (docs/architecture.md): lmrepo's packages in layers, each import running
down a layer or within one (imports inside functions included), no import circle, engines that never
import each other, the library never importing the benchmarks, and lmrepo's own validation without
hand-written type checks (the schema's types do that)."""

import ast
import re
from pathlib import Path

from harness import REPO

PACKAGE = REPO / "lmrepo"

# The commands: what scripts/ and train.py run. Everything else sits in a package.
COMMANDS = ("run", "estimate", "generate", "export", "compare", "evaluate")

# lmrepo's layers, lowest first. A module imports modules of its own layer and of lower layers,
# never of a higher one; each package's one sentence (its __init__'s docstring, first sentence)
# says what it owns, and docs/architecture.md shows the same table.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("utils",),
    ("observability",),
    ("config",),
    ("data",),
    ("models",),
    ("distributed",),
    ("optim",),
    ("plan",),
    ("engines",),
    ("train",),
    ("evaluation",),
    COMMANDS,
)

# The modules of lmrepo/engines/ that are engines (each with its `build`): they share helpers through
# the other modules of engines/ and the lower layers, never through each other.
ENGINES = ("deepspeed", "deepspeed_pipeline", "fsdp2", "torch_pipeline")

LONGEST_FUNCTION = 80  # lines


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, name: str, modules: set[str], is_package: bool = False) -> set[str]:
    """The lmrepo modules `source` (module `name`) imports, at module level and inside functions."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*parent, base] if base else parent)
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    resolved = set()
    for imported in found:
        while imported and imported not in modules:  # `from lmrepo.x import a_function` -> lmrepo.x
            imported = imported.rpartition(".")[0]
        if imported.startswith("lmrepo") and imported != name:
            resolved.add(imported)
    return resolved


def graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {
        name: imports_of(path.read_text(), name, set(paths), path.name == "__init__.py") for name, path in paths.items()
    }


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the package (or command) `module` belongs to; None: in none."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    for index, members in enumerate(LAYERS):
        if parts[1] in members:
            return index
    return None


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    """Each import that runs from a lower layer up to a higher one, as 'importer -> imported'."""
    return sorted(
        f"{src} -> {dst}"
        for src, targets in edges.items()
        for dst in targets
        if layer_of(src) is not None and layer_of(dst) is not None and layer_of(dst) > layer_of(src)
    )


def cycles_in(edges: dict[str, set[str]]) -> list[list[str]]:
    found = []

    def visit(node, stack, done):
        if node in stack:
            found.append(stack[stack.index(node) :] + [node])
            return
        if node in done:
            return
        for nxt in edges.get(node, ()):
            # a package's __init__ importing its own submodules is not a cycle
            if not nxt.startswith(node + "."):
                visit(nxt, stack + [node], done)
        done.add(node)

    done = set()
    for module in sorted(edges):
        visit(module, [], done)
    return found


def test_no_import_cycles():
    assert cycles_in(graph()) == []


def test_imports_run_down_the_layers():
    assert upward_imports(graph()) == []


def test_a_planted_upward_import_is_caught_inside_a_function_too():
    """The checks see an import a function makes when it runs, not only the module's own."""
    edges = graph()
    source = (PACKAGE / "utils" / "errors.py").read_text() + "\n\ndef planted():\n    from lmrepo.run import train\n"
    edges["lmrepo.utils.errors"] = imports_of(source, "lmrepo.utils.errors", set(edges))
    assert upward_imports(edges) == ["lmrepo.utils.errors -> lmrepo.run"]
    assert any({"lmrepo.utils.errors", "lmrepo.run"} <= set(cycle) for cycle in cycles_in(edges))


def test_every_module_sits_in_a_layer():
    """The top level holds the commands; every other module is in one of LAYERS' packages."""
    top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert top == sorted(COMMANDS)
    packages = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    assert packages == sorted(name for layer in LAYERS[:-1] for name in layer)
    assert [m for m in graph() if m != "lmrepo" and layer_of(m) is None] == []


def sentence(package: str) -> str:
    """The first sentence of the package's docstring: what it owns."""
    doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text())) or ""
    return re.split(r"(?<=\.)\s", " ".join(doc.split()), maxsplit=1)[0]


def test_each_package_says_what_it_owns_and_the_architecture_page_shows_it():
    page = " ".join((REPO / "docs" / "architecture.md").read_text().split())
    for layer in LAYERS[:-1]:
        for package in layer:
            owns = sentence(package)
            assert len(owns.split()) >= 6, (package, owns)
            assert f"`lmrepo/{package}/`" in page and owns in page, (package, owns)


def test_engines_never_import_each_other():
    engines = {f"lmrepo.engines.{name}" for name in ENGINES}
    assert {src: dst & engines for src, dst in graph().items() if src in engines and dst & engines} == {}


def test_no_function_is_longer_than_a_screen():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST_FUNCTION:
                    long.append(f"{path.relative_to(REPO)}:{node.name} ({lines} lines)")
    assert long == []


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
