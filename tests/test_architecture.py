"""The import arrows of docs/ARCHITECTURE.md: kernels <- adapters <- engine <- platform <- ui <- cli,
and the console's rule: it calls the platform's public services only (no private names, no crud/models).

Every ``import`` in the package counts, at module level or inside a function
(lazy imports and ``TYPE_CHECKING`` blocks included), parsed with ``ast``
(nothing is imported). A package may import its own modules and those of the
layers below it, never a layer above. The kernels, adapters and engine may
import only the third-party packages listed in ``THIRD_PARTY`` (plus the
standard library).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "loraplex"

# Layer of each part of the package (``loraplex/<part>/...`` or ``loraplex/<part>.py``); higher imports lower.
LAYERS = {
    "kernels": 0,
    "adapters": 1,
    "engine": 2,
    "platform": 3,
    "ui": 4,
    "cli": 5,  # loraplex/cli.py: the command line; it mounts the console (ui) on the platform's app
    "__init__": 5,  # loraplex/__init__.py: re-exports the engine's offline API (``from loraplex import LLM``)
}

# Third-party top-level modules a part may import; parts not listed are unrestricted.
THIRD_PARTY = {
    "kernels": {"torch", "triton"},
    # regex: user patterns of adapter configs matched with a timeout; a dependency of transformers. numpy (a
    # dependency of torch's ``Tensor.numpy``): a first read's per-tensor views and batched copies, which keep the
    # GIL where torch tensors would release it at each op and deallocation (adapters/tensor_file.py)
    "adapters": {"torch", "safetensors", "transformers", "regex", "numpy"},
    # tokenizers: the Rust core of transformers' fast tokenizers, a dependency of transformers (the
    # detokenizer's DecodeStream)
    "engine": {"torch", "triton", "transformers", "safetensors", "tokenizers"},
}

# Optional third-party packages a part may import lazily (inside a function, never at module level), so
# that the part still imports without them: the engine's structured output (issue 20) needs xgrammar
# only when a request asks for a constraint.
OPTIONAL_LAZY = {
    "engine": {"xgrammar"},
}

# Upward arrows that another open issue removes, as (importing file, imported part).
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()


def imported_modules(source: str, module: str) -> list[str]:
    """Absolute names of every module ``source`` (the module ``module``) imports, at any nesting level.

    ``from a import b`` yields ``a.b`` (b may be a submodule); relative imports are resolved.
    """
    names = []
    package = module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            names += [f"{base}.{alias.name}" for alias in node.names]
    return names


def part_of(module: str) -> str:
    """``loraplex.engine.scheduler`` -> ``engine``; ``loraplex.cli`` -> ``cli``; ``loraplex`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "__init__"


def arrow_violations(rel_path: str, source: str) -> list[tuple[str, str, str]]:
    """``(file, imported module, why)`` for each import of ``source`` (at ``loraplex/<rel_path>``) that breaks a rule."""
    module = "loraplex." + rel_path.removesuffix(".py").replace("/", ".")
    importer = part_of(module)
    allowed = THIRD_PARTY.get(importer)
    lazy_ok = OPTIONAL_LAZY.get(importer, set())
    module_level = {name.split(".")[0] for node in ast.parse(source).body
                    for name in imported_modules(ast.unparse(node), module)
                    if isinstance(node, (ast.Import, ast.ImportFrom))}
    found = []
    for name in imported_modules(source, module):
        top = name.split(".")[0]
        if top == "loraplex":
            target = part_of(name)
            if target != importer and LAYERS[target] >= LAYERS[importer]:
                found.append((rel_path, name, f"{importer} (layer {LAYERS[importer]}) imports {target}"))
        elif top in lazy_ok and top not in module_level:
            continue
        elif allowed is not None and top not in allowed and top not in sys.stdlib_module_names:
            found.append((rel_path, name, f"{importer} may import only {sorted(allowed)} and the standard library"))
    return found


def package_violations() -> list[tuple[str, str, str]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        found += arrow_violations(rel, path.read_text(encoding="utf-8"))
    return found


def test_package_follows_the_import_arrows():
    found = package_violations()
    unexpected = [v for v in found if (v[0], part_of(v[1])) not in KNOWN_VIOLATIONS]
    assert unexpected == [], "\n".join(f"{f}: import {m}: {why}" for f, m, why in unexpected)
    stale = KNOWN_VIOLATIONS - {(f, part_of(m)) for f, m, _ in found}
    assert stale == set(), f"fixed, remove from KNOWN_VIOLATIONS: {sorted(stale)}"


def test_every_part_of_the_package_has_a_layer():
    parts = {p.name.removesuffix(".py") for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert parts == set(LAYERS)


def test_checker_sees_lazy_relative_and_from_imports():
    source = (
        "import torch\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from loraplex.engine.llm_engine import EngineStats\n"
        "def f():\n"
        "    from loraplex import platform\n"
        "    from ..ui import console\n"
        "    import numpy\n"
    )
    found = arrow_violations("kernels/example.py", source)
    assert sorted((m, why) for _, m, why in found) == [
        ("loraplex.engine.llm_engine.EngineStats", "kernels (layer 0) imports engine"),
        ("loraplex.platform", "kernels (layer 0) imports platform"),
        ("loraplex.ui.console", "kernels (layer 0) imports ui"),
        ("numpy", "kernels may import only ['torch', 'triton'] and the standard library"),
    ]
    assert arrow_violations("platform/main.py", "from loraplex.ui import mount_console\n") == [
        ("platform/main.py", "loraplex.ui.mount_console", "platform (layer 3) imports ui")
    ]
    assert arrow_violations("cli.py", "from loraplex.ui import mount_console\nimport packaging\n") == []


# What the console (ui) may import of the platform: its services and the plain data / error types they
# take and return (console -> services -> crud -> models). Never crud, models or the database directly.
CONSOLE_FORBIDDEN = ("loraplex.platform.crud", "loraplex.platform.models", "loraplex.platform.db")


def console_violations(rel_path: str, source: str) -> list[tuple[str, str, str]]:
    """``(file, what, why)`` for each place a console module (``loraplex/ui/<rel_path>``) reaches past the
    platform's public services: a private name (leading underscore) imported from another layer or read as
    an attribute of anything but ``self`` / ``cls`` (``engine._submit``, ``adapter_service._stage``), or an
    import of crud / models / db."""
    module = "loraplex." + rel_path.removesuffix(".py").replace("/", ".")
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            names = imported_modules(ast.unparse(node), module)
            for alias, name in zip(node.names, names):
                if part_of(name) != "ui" and alias.name.startswith("_"):
                    found.append((rel_path, name, "imports a private name of another layer"))
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for name in imported_modules(ast.unparse(node), module):
                if name.startswith(CONSOLE_FORBIDDEN):
                    found.append((rel_path, name, "the console calls services, never crud/models/db"))
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append((rel_path, f"{ast.unparse(node.value)}.{node.attr}", "reads a private attribute"))
    return found


def test_the_console_uses_only_public_services():
    found = []
    for path in sorted((PACKAGE / "ui").rglob("*.py")):
        found += console_violations(path.relative_to(PACKAGE).as_posix(), path.read_text(encoding="utf-8"))
    assert found == [], "\n".join(f"{f}: {what}: {why}" for f, what, why in found)


def test_console_checker_sees_private_names_and_crud():
    source = (
        "from loraplex.platform.services.adapters import _check_name, validate_upload\n"
        "from loraplex.engine.llm_engine import _Throughput\n"
        "from loraplex.platform import crud\n"
        "from loraplex.ui.wiring import _private_helper_of_the_console\n"
        "def f(engine, adapter_service, self):\n"
        "    engine._submit(lambda: None)\n"
        "    adapter_service._stage()\n"
        "    self._ok, engine.__class__\n"
    )
    assert sorted((what, why) for _, what, why in console_violations("ui/x.py", source)) == [
        ("adapter_service._stage", "reads a private attribute"),
        ("engine._submit", "reads a private attribute"),
        ("loraplex.engine.llm_engine._Throughput", "imports a private name of another layer"),
        ("loraplex.platform.crud", "the console calls services, never crud/models/db"),
        ("loraplex.platform.services.adapters._check_name", "imports a private name of another layer"),
    ]


def test_optional_packages_are_imported_lazily_only():
    src = "import xgrammar\n"
    assert arrow_violations("engine/x.py", src), "a module-level optional import must be refused"
    assert not arrow_violations("engine/x.py", "def f():\n    import xgrammar\n")


def test_test_file_names_are_unique():
    """pytest imports test files by basename (rootdir-relative, no packages): two files of one name in different
    folders make the whole run stop at collection."""
    names: dict[str, list[str]] = {}
    for path in sorted((Path(__file__).resolve().parent).rglob("test_*.py")):
        names.setdefault(path.name, []).append(str(path.relative_to(path.parents[1])))
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}
