"""The project's modules import each other without a cycle, function-level imports included.

A cycle is how the patches used to find their shared state; `patches/context.py` and
`patches/hooks.py` are leaves so that it cannot come back unnoticed.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Source folder -> the package name it is installed as.
PACKAGES = {
    "sglang_kvsparse": "sglang_kvsparse",
    "kernels": "sglang_kvsparse.kernels",
    "patches": "sglang_kvsparse.patches",
}


def module_name(path: Path) -> str:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    parts = [PACKAGES[folder], *rest]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for folder in PACKAGES for path in (ROOT / folder).rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules `name` imports anywhere in its file (but for type checkers only)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        for inner in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in known and target != name)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_among_the_projects_modules():
    modules = project_modules()
    assert "sglang_kvsparse.patches.plugin" in modules and "sglang_kvsparse.kernels.evict" in modules
    graph = {name: imports_of(name, path, set(modules)) for name, path in modules.items()}
    assert "sglang_kvsparse.patches.context" in graph["sglang_kvsparse.patches.admission"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


#: Each subpackage of the product and the ones it may not import: a call goes down the layers
#: (patches -> server, forward -> state -> config, policies), never back up.
LAYERS = {
    "sglang_kvsparse.state": ("sglang_kvsparse.forward", "sglang_kvsparse.server", "sglang_kvsparse.patches"),
    "sglang_kvsparse.forward": ("sglang_kvsparse.server", "sglang_kvsparse.patches"),
    "sglang_kvsparse.config": ("sglang_kvsparse.state", "sglang_kvsparse.forward", "sglang_kvsparse.server"),
    "sglang_kvsparse.policies": ("sglang_kvsparse.state", "sglang_kvsparse.forward", "sglang_kvsparse.server"),
    "sglang_kvsparse.kernels": ("sglang_kvsparse.state", "sglang_kvsparse.forward", "sglang_kvsparse.server"),
}


def test_no_layer_imports_a_layer_above_it():
    modules = project_modules()
    known = set(modules)
    found = [
        (name, target)
        for name, path in modules.items()
        for package, above in LAYERS.items()
        if name.startswith(package + ".") or name == package
        for target in imports_of(name, path, known)
        if target.startswith(above)
    ]
    assert not found, found


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_context_and_hooks_are_leaves():
    modules = project_modules()
    for leaf in ("sglang_kvsparse.patches.context", "sglang_kvsparse.patches.hooks"):
        patches = {m for m in imports_of(leaf, modules[leaf], set(modules)) if ".patches." in m}
        assert not patches, (leaf, patches)


def test_the_wheel_ships_the_product_without_the_test_bed():
    """`kvsparse_testbed` (prompts, essays, a server manager) serves tests and benchmarks only:
    the wheel's packages are the product's, and nothing in them imports the test bed."""
    import tomllib

    root = Path(__file__).resolve().parents[2]
    packages = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert all(name.startswith("sglang_kvsparse") for name in packages), packages
    for folder in ("sglang_kvsparse", "kernels", "patches"):
        for source in (root / folder).rglob("*.py"):
            assert "kvsparse_testbed" not in source.read_text(), source


#: The most lines a module of the product's core (`sglang_kvsparse/`, `patches/`) may have: past
#: it, a module has more than one job. The Triton kernel files (a kernel, its launcher and its
#: reference together) are not held to it.
MODULE_LINES = 400


def test_every_core_module_stays_small() -> None:
    core = {name: path for name, path in project_modules().items() if not name.startswith("sglang_kvsparse.kernels")}
    long = {name: n for name, path in core.items() if (n := len(path.read_text().splitlines())) > MODULE_LINES}
    assert not long, f"modules over {MODULE_LINES} lines (split them by job): {long}"


#: Names retired for meaning two things (`docs/architecture.md`, "Words"): a request index is
#: `req_idx` / `req_indices`, a sparse layer's place a `LayerPlace`, a request's record `Requests`,
#: the entries a request holds a count (`EntryTable.counts`), `span`'s best key a peak, writing a
#: lane's K/V `write_entries` (the store is the prefix store's only). (`req` stays SGLang's request
#: object in the patches.)
RETIRED_NAMES = {
    "row",
    "slot",
    "RowTable",
    "SparseSlot",
    "sparse_slots",
    "running_rows",
    "row_budget",
    "RequestTable",
    "best_places",
    "store_entries",
    "_store",
    "_store_all",
}


def test_retired_words_are_gone_and_the_glossary_names_the_new_ones() -> None:
    """No argument, variable, attribute or class of the product's code is named as a request index
    or a layer's place was before (`row` held both a request index and a heap row). The Triton
    kernels keep their own words for their program axes (`req`, `slot`: `docs/kernels.md`)."""
    found = []
    for name, path in project_modules().items():
        if name.startswith("sglang_kvsparse.kernels"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.arg):
                names = [node.arg]
            elif isinstance(node, ast.Name | ast.Attribute):
                names = [node.id if isinstance(node, ast.Name) else node.attr]
            elif isinstance(node, ast.FunctionDef | ast.ClassDef):
                names = [node.name]
            found += [(name, n, node.lineno) for n in names if n in RETIRED_NAMES]
    assert not found, found
    words = (ROOT / "docs" / "architecture.md").read_text().split("## Words", 1)[1].split("\n## ", 1)[0]
    for word in (
        "| heap row |",
        "| request index (`req_idx`) |",
        "| place (`LayerPlace`) |",
        "| slot |",
        "| record |",
        "| count |",
        "| length |",
        "| store |",
        "| peak |",
    ):
        assert word in words, word
