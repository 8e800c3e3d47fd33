"""Each object of the product changes only its own fields: no module writes a field of a project
object other than through that object's methods (`docs/architecture.md`, "A request's sparse rows").

A field is any attribute a product class (`sglang_kvsparse/`) sets on `self` or declares as a
dataclass field. A write is an assignment to it (`a.field = ...`, `a.field[...] = ...`,
`a.field += ...`) or an in-place call on it (`a.field.zero_()`, `.append(...)`, ...). It is the
object's own when `a` is `self`; anything else (`other.field`, `self.other.field`) is another
object's. Frozen dataclasses (plain records of tensors: a lane's K/V buffers, a plan's tables)
hold device memory the kernels write, not fields, and are left out; so are the patches' writes to
SGLang's objects, which is what they are for.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ROOT / "sglang_kvsparse"
CHECKED = (PRODUCT, ROOT / "patches")
#: In-place calls that change the object they are called on.
MUTATORS = {
    "add_",
    "append",
    "appendleft",
    "clamp_",
    "clear",
    "copy_",
    "discard",
    "extend",
    "fill_",
    "index_add_",
    "index_put_",
    "masked_fill_",
    "pop",
    "popleft",
    "remove",
    "scatter_",
    "setdefault",
    "update",
    "zero_",
}


#: (file, field) writes of objects that are not the product's though a product class has a field
#: of that name: importlib's module spec in the CPU shims.
ALLOWED = {("cpu_shims.py", "loader")}


def _frozen(cls: ast.ClassDef) -> bool:
    for deco in cls.decorator_list:
        if isinstance(deco, ast.Call) and getattr(deco.func, "id", None) == "dataclass":
            if any(k.arg == "frozen" and getattr(k.value, "value", False) for k in deco.keywords):
                return True
    return False


def product_fields() -> set[str]:
    """Every field a mutable class of the product has."""
    fields: set[str] = set()
    for path in PRODUCT.rglob("*.py"):
        for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
            if _frozen(cls):
                continue
            for node in ast.walk(cls):
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    fields.add(node.target.id)
                targets = node.targets if isinstance(node, ast.Assign) else []
                if isinstance(node, ast.AnnAssign | ast.AugAssign):
                    targets = [node.target]
                for target in targets:
                    for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                        if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "self":
                            fields.add(t.attr)
    return fields


def _written(node: ast.AST) -> ast.Attribute | None:
    """The attribute an assignment target or an in-place call writes (through any subscripts)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return node if isinstance(node, ast.Attribute) else None


def foreign_writes() -> list[str]:
    fields = product_fields()
    found = []
    for folder in CHECKED:
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                targets: list[ast.AST] = []
                if isinstance(node, ast.Assign):
                    targets = [
                        t
                        for target in node.targets
                        for t in (target.elts if isinstance(target, ast.Tuple) else [target])
                    ]
                elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                    targets = [node.target]
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                    targets = [node.func.value]
                for target in targets:
                    attribute = _written(target)
                    if attribute is None or attribute.attr not in fields:
                        continue
                    owner = attribute.value
                    if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                        continue
                    if (path.name, attribute.attr) in ALLOWED:
                        continue
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(target)}")
    return found


def test_no_module_writes_another_objects_fields() -> None:
    assert foreign_writes() == []


def test_the_rule_sees_a_write_through_another_object(tmp_path: Path, monkeypatch) -> None:
    import sys

    (tmp_path / "bad.py").write_text(
        "def f(state, idx):\n    state.requests.phase[idx] = 4\n    state.heap.give(idx)\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "CHECKED", (tmp_path,))
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert foreign_writes() == ["bad.py:2: state.requests.phase[idx]"]
