"""The package's import graph: layers that only import downwards, no cycles, and an ``import
gpupipe`` that loads no backend library and no command-line module.

Read from the sources (``ast``), every import statement counted: lazy ones inside functions, and
those under ``if TYPE_CHECKING:`` too (a type that names a higher layer is knowledge of it).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator

ROOT = os.path.join(os.path.dirname(__file__), "..")
PACKAGE = os.path.join(ROOT, "gpupipe")

# Bottom up: a unit imports only from itself and the units below it. A unit is a folder of the
# package (its modules import each other freely, without cycles) or one of the public modules at
# its root; the order is the one docs/architecture.md draws.
LAYERS = (
    "core",  # errors, argument checks, random draws, geometry, image headers, the batch, options
    "fields",  # gp.fields: a sample's fields beyond image and label (public module)
    "runtime",  # rank/world/worker, child processes, the decoder sandbox, nvJPEG
    "testing",  # gp.testing: fake images (public module)
    "storage",  # byte access: local, remote, the shard cache
    "transforms",  # definitions only, no backend
    "shards",  # a shard's index: tar scanning, the index cache, the files beside the shards
    "sources",  # the dataset formats
    "pipeline",  # gp.Pipeline and gp.check
    "plan",  # what an epoch holds: rank and mix plans, positions, skips
    "backends",
    "loader",  # gp.Loader, the trainers' view of it, gp.tune and its records
    "lightning",  # gp.lightning (public module)
    "cli",
    "__main__",
    "__init__",
)
PACKAGES = tuple(u for u in LAYERS if os.path.isdir(os.path.join(PACKAGE, u)))


def modules() -> dict[str, str]:
    """``{"gpupipe.sources._webdataset": path, ...}``."""
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[module.removesuffix(".__init__")] = path
    return out


def unit(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def imports(module: str, path: str, known: dict[str, str]) -> Iterator[tuple[int, str]]:
    """``(line, imported module)`` for each gpupipe module ``module`` imports."""
    with open(path) as f:
        tree = ast.parse(f.read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
        else:
            continue
        for target in targets:
            if target in known:
                yield node.lineno, target


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: {t for _, t in imports(m, p, known)} - {m} for m, p in known.items()}


class TestLayers:
    def test_every_unit_has_a_layer(self):
        assert {unit(m) for m in modules()} == set(LAYERS)
        assert all(os.path.isdir(os.path.join(PACKAGE, p)) for p in PACKAGES)

    def test_the_architecture_page_draws_these_floors(self):
        """docs/architecture.md's table of floors is this order, folder for folder."""
        import re

        with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
            text = f.read()
        drawn = re.findall(r"^\| [\w ]+ \| `gpupipe/(\w+)(?:/|\.py)` \|", text.split("## Layers")[1], re.M)
        assert drawn == [u for u in LAYERS if u not in ("__main__", "__init__")]

    def test_imports_go_downwards(self):
        known = modules()
        upward = []
        for module, path in known.items():
            here = LAYERS.index(unit(module))
            for line, target in imports(module, path, known):
                there = LAYERS.index(unit(target))
                if there > here:
                    upward.append(f"{os.path.relpath(path, ROOT)}:{line} imports {target} ({LAYERS[there]} is above)")
        assert not upward, "\n".join(upward)

    def test_no_cycles(self):
        edges = graph()
        cycles = []
        state: dict[str, int] = {}  # 1: on the path, 2: done
        path: list[str] = []

        def visit(m: str) -> None:
            state[m] = 1
            path.append(m)
            for t in sorted(edges[m]):
                if state.get(t) == 1:
                    cycles.append(" -> ".join([*path[path.index(t) :], t]))
                elif t not in state:
                    visit(t)
            path.pop()
            state[m] = 2

        for m in sorted(edges):
            if m not in state:
                visit(m)
        assert not cycles, "\n".join(cycles)

    def test_the_checker_sees_a_cycle_and_an_upward_import(self, tmp_path, monkeypatch):
        """The checks above are not vacuous: a made-up package with both faults is caught."""
        pkg = tmp_path / "gpupipe"
        (pkg / "storage").mkdir(parents=True)
        (pkg / "core").mkdir()
        for folder in (pkg, pkg / "storage", pkg / "core"):
            (folder / "__init__.py").write_text("")
        (pkg / "core" / "_errors.py").write_text("from ..storage import _base\n")
        (pkg / "storage" / "_base.py").write_text(
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..core._errors import X\n"
        )
        monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
        monkeypatch.setattr(sys.modules[__name__], "PACKAGE", str(pkg))
        edges = graph()
        assert edges["gpupipe.core._errors"] == {"gpupipe.storage._base"}
        assert edges["gpupipe.storage._base"] == {"gpupipe.core._errors"}
        known = modules()
        found = list(imports("gpupipe.core._errors", str(pkg / "core" / "_errors.py"), known))
        assert LAYERS.index(unit(found[0][1])) > LAYERS.index("core")


def test_import_gpupipe_loads_no_backend_and_no_command():
    code = (
        "import sys, gpupipe\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('nvidia', 'gpupipe.cli', 'gpupipe.backends._dali',"
        " 'gpupipe.backends._torch', 'lightning', 'accelerate', 'cupy', 'fsspec.implementations.http')))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_one_place_tells_the_index_kinds_apart():
    """``plan/_planner.planner_for`` picks a planner by index kind; nothing else asks whether an
    index is a mix's (``sources/_mix.py`` defines it)."""
    asking = []
    for module, path in modules().items():
        if module in ("gpupipe.plan._planner", "gpupipe.sources._mix"):
            continue
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if "isinstance(" in line and "MixIndex" in line:
                    asking.append(f"{os.path.relpath(path, ROOT)}:{number}")
    assert not asking, asking
