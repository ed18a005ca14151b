"""Layers that only point down: no module of tp_kernels imports a module of a higher layer.

The layers are those of docs/DESIGN.md's table, top to bottom, with the same names. Every import
of every module is read with ``ast``: at module level and inside functions (a function-level
import is still a dependency, only a later one), ``import tp_kernels.x``, ``from tp_kernels
import x``, ``from tp_kernels.x import y`` and relative imports. A module may import modules of
its own layer and of any layer ranked below its own; two layers of one rank are independent.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tp_kernels"

# (layer, rank, module prefixes), in the order of DESIGN.md's table. A module belongs to the
# layer of its longest matching prefix; "tp_kernels" itself (the package's __init__, the public
# names) matches only exactly.
LAYERS: tuple[tuple[str, int, tuple[str, ...]], ...] = (
    ("tools", 9, ("tp_kernels.bench", "tp_kernels.testing", "tp_kernels.examples")),
    ("package", 8, ("tp_kernels",)),
    ("integrations", 7, ("tp_kernels.integrations",)),
    ("models", 6, ("tp_kernels.models",)),
    (
        "styles",
        5,
        (
            "tp_kernels.styles",
            "tp_kernels.api",
            "tp_kernels.float8",
            "tp_kernels.float8_tensor_parallel",
            "tp_kernels.mxfp8",
            "tp_kernels.quantized_linears",
        ),
    ),
    ("ops", 4, ("tp_kernels.ops",)),
    ("backends", 3, ("tp_kernels.backends",)),
    ("cost model", 2, ("tp_kernels.cost",)),
    ("kernels", 2, ("tp_kernels.kernels",)),
    ("symmetric memory", 2, ("tp_kernels.symmetric_memory",)),
    ("deadline", 1, ("tp_kernels.deadline",)),
    ("tiling", 1, ("tp_kernels.tiling",)),
    ("config", 0, ("tp_kernels.config",)),
    ("signals", 0, ("tp_kernels.signals",)),
    ("compat", 0, ("tp_kernels._compat",)),
    ("native", 0, ("tp_kernels._C",)),
)
RANK = {name: rank for name, rank, _ in LAYERS}


def layer_of(module: str) -> str:
    """The layer of the dotted ``module`` name (a module of tp_kernels)."""
    best = None
    for name, _, prefixes in LAYERS:
        for prefix in prefixes:
            exact = prefix == "tp_kernels"
            if module == prefix or (not exact and module.startswith(prefix + ".")):
                if best is None or len(prefix) > len(best[1]):
                    best = (name, prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS and to DESIGN.md's table")
    return best[0]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(dotted: str) -> bool:
    """Whether ``dotted`` names a module or package of the source tree (or the native ``_C``)."""
    path = ROOT.joinpath(*dotted.split("."))
    return (
        path.with_suffix(".py").exists()
        or (path / "__init__.py").exists()
        or (dotted == "tp_kernels._C")
    )


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every tp_kernels module that the file at ``path`` imports."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                # ``from package import name``: the submodule when there is one, else the
                # package whose name it is.
                sub = f"{origin}.{alias.name}"
                found.append((node.lineno, sub if _is_module(sub) else origin))
    return [(line, m) for line, m in found if m == "tp_kernels" or m.startswith("tp_kernels.")]


def upward_imports() -> list[str]:
    """Every import of a module of a higher layer, or of an independent layer of the same rank."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        own = layer_of(name)
        for line, target in imported_modules(path):
            theirs = layer_of(target)
            if theirs != own and RANK[theirs] >= RANK[own]:
                where = f"{path.relative_to(ROOT)}:{line}"
                wrong.append(f"{where}: {name} ({own}) imports {target} ({theirs})")
    return wrong


def test_no_module_imports_a_layer_above_it():
    wrong = upward_imports()
    assert not wrong, "imports that point up or across:\n" + "\n".join(wrong)


def test_the_layers_are_design_md_table_top_to_bottom():
    design = (ROOT / "docs" / "DESIGN.md").read_text()
    section = design.split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]  # no header
    names = [re.match(r"\| ([^|]+?) \|", row).group(1) for row in rows]
    assert names == [name for name, _, _ in LAYERS]


def test_imports_are_read_in_every_form(tmp_path, monkeypatch):
    """The reader sees function-level, ``from package import module`` and relative imports."""
    src = tmp_path / "tp_kernels" / "backends"
    src.mkdir(parents=True)
    (tmp_path / "tp_kernels" / "__init__.py").write_text("")
    (tmp_path / "tp_kernels" / "cost.py").write_text("")
    (src / "__init__.py").write_text("")
    (src / "base.py").write_text("")
    probe = src / "probe.py"
    probe.write_text(
        "from tp_kernels import cost\n"
        "from . import base\n"
        "from .. import cost as c\n"
        "def f():\n"
        "    import tp_kernels.ops.planning\n"
        "    from tp_kernels.backends.base import Backend\n"
    )
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert imported_modules(probe) == [
        (1, "tp_kernels.cost"),
        (2, "tp_kernels.backends.base"),
        (3, "tp_kernels.cost"),
        (5, "tp_kernels.ops.planning"),
        (6, "tp_kernels.backends.base"),
    ]
