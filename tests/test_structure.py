"""Which way imports point, read from the source with ast (nothing is imported, so no import
side effects and no optional dependency is needed).

Every import counts, function-level and ``if TYPE_CHECKING:`` ones included: a type-only
import still ties one layer to another, and a lazy one is a circle waiting for a refactor.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def import_graph(package: str, root: Path = ROOT) -> dict[str, set[str]]:
    """Each module of ``package`` (a dotted name under ``root``, its subpackages
    included) -> the modules of that package it imports. Relative imports are resolved;
    ``from a import b`` imports the module ``a.b`` where there is one, else ``a``."""
    top = root.joinpath(*package.split("."))
    files: dict[str, Path] = {}
    for path in sorted(top.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        # The package a relative import starts from: the module's own for an __init__.py.
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here[: len(here) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                deps |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
        graph[name] = (deps & files.keys()) - {name}
    return graph


def assert_no_circles(graph: dict[str, set[str]]) -> None:
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"import circle: {' -> '.join(exc.args[1])}")


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The helper itself: absolute, from-, relative, function-level and TYPE_CHECKING imports
    are edges, and a circle is reported with its path."""
    pkg = tmp_path / "pkg_t"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import pkg_t.b\n")
    (pkg / "b.py").write_text("from pkg_t import c\n")
    (pkg / "c.py").write_text("def f():\n    from .sub import d\n")
    (pkg / "sub" / "__init__.py").write_text("from . import d\n")
    (pkg / "sub" / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import X\n    from .. import Y\n"
    )
    graph = import_graph("pkg_t", tmp_path)
    assert graph == {
        "pkg_t": set(),
        "pkg_t.a": {"pkg_t.b"},
        "pkg_t.b": {"pkg_t.c"},
        "pkg_t.c": {"pkg_t.sub.d"},
        "pkg_t.sub": {"pkg_t.sub.d"},
        "pkg_t.sub.d": {"pkg_t", "pkg_t.a"},
    }
    with pytest.raises(pytest.fail.Exception, match="import circle: "):
        assert_no_circles(graph)


def test_the_sidecar_imports_point_one_way() -> None:
    """protocols -> core -> apis, never back: core and apis name no protocol, and apis import
    nothing of the sidecar outside themselves (they are fed bytes and report through hooks,
    sidecar/apis/README.md); no circles anywhere in the sidecar."""
    graph = import_graph("sidecar")
    assert "sidecar.core.telemetry" in graph and "sidecar.protocols.http1" in graph  # it found the tree
    wrong = []
    for name, deps in sorted(graph.items()):
        banned = []
        if _under(name, "sidecar.core") or _under(name, "sidecar.apis"):
            banned.append("sidecar.protocols")
        wrong += [f"{name} imports {d}" for d in sorted(deps) for b in banned if _under(d, b)]
        if _under(name, "sidecar.apis"):  # sidecar.core, sidecar.config, sidecar.main, ...
            wrong += [f"{name} imports {d}" for d in sorted(deps) if not _under(d, "sidecar.apis")]
    assert wrong == []
    assert_no_circles(graph)


def test_the_stack_modules_import_one_way() -> None:
    """No import circles among inferwatch/stack/: the command module sits on top, the
    scenario below it, the supervisor at the bottom."""
    graph = import_graph("inferwatch.stack")
    assert_no_circles(graph)
    assert all("inferwatch.stack.cli" not in deps for deps in graph.values())
    assert graph["inferwatch.stack.demo"] <= {
        "inferwatch.stack.core",
        "inferwatch.stack.observe",
        "inferwatch.stack.timing",
    }


def test_every_command_reads_its_spec_through_one_loader() -> None:
    """The components read a spec file only through ``inferwatch.spec.load_spec_for_cli``
    (one default path, one error style); ``load_spec`` itself is that loader's helper."""
    packages = (
        "alert_rules",
        "dashboards",
        "deploy",
        "exporters",
        "inferwatch",
        "reference_server",
        "sidecar",
    )
    direct = []
    for path in sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py")):
        if path == ROOT / "inferwatch" / "spec.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            func = node.func if isinstance(node, ast.Call) else None
            name = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else None
            )
            if name == "load_spec":
                direct.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert direct == []
