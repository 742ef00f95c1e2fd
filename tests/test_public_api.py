"""The public API is where users look for it: every name a package exports imports, and every
`from <our package> import ...` written in the README, docs/ and examples/ resolves."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("slime_env", "slime_env.envs", "slime_env.agents", "slime_env.tools_sandbox", "slime_env.trainers",
            "slime_env.tools_sandbox.workspace", "slime_env.envs.workspace", "slime_env.envs.harbor")
# The repository's folders of those packages: they install under `slime_env`, never as top-level names.
FOLDERS = {"slime_env": "slime_env", "envs": "slime_env.envs", "agents": "slime_env.agents",
           "tools_sandbox": "slime_env.tools_sandbox", "trainers": "slime_env.trainers"}


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_imports(package):
    module = importlib.import_module(package)
    names = getattr(module, "__all__", None)
    assert names, f"{package} declares no __all__"
    for name in names:
        assert getattr(module, name) is not None, f"{package}.{name}"


def _code_of(path: Path) -> list[str]:
    text = path.read_text()
    if path.suffix == ".py":
        return [text]
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _imports(source: str) -> list[tuple[str, list[str]]]:
    try:
        tree = compile(source, "<doc>", "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except SyntaxError:  # a snippet with "..." placeholders: take its single-line imports
        found = []
        for line in source.splitlines():
            m = re.match(r"\s*from ([\w.]+) import ([\w, ]+)$", line)
            if m:
                found.append((m.group(1), [n.strip() for n in m.group(2).split(",") if n.strip()]))
        return found
    return [(node.module, [a.name for a in node.names]) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0]


# Files whose imports of a name like one of our folders mean another package: the OpenAI Agents SDK imports as `agents`.
FOREIGN = {"examples/openai_agents_sdk.py": {"agents"}}


def test_imports_written_in_docs_and_examples_resolve():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*.py"))]
    checked, broken = 0, []
    for path in files:
        foreign = FOREIGN.get(str(path.relative_to(ROOT)), set())
        for block in _code_of(path):
            for module_name, names in _imports(block):
                top = module_name.split(".")[0]
                if top in FOLDERS and top != "slime_env" and top not in foreign:  # the spelling before one name
                    broken.append(f"{path.relative_to(ROOT)}: from {module_name} (write slime_env.{module_name})")
                if top != "slime_env":
                    continue
                module = importlib.import_module(module_name)
                for name in names:
                    checked += 1
                    if not hasattr(module, name):
                        try:
                            importlib.import_module(f"{module_name}.{name}")  # a submodule
                        except ImportError:
                            broken.append(f"{path.relative_to(ROOT)}: from {module_name} import {name}")
    assert checked > 30
    assert not broken, broken


def test_the_names_users_write_import_from_the_package_tops():
    from slime_env.trainers import MegatronTrainer, TorchTrainer, TrainerConfig  # noqa: F401

    from slime_env import RemoteEnv  # noqa: F401


def test_no_two_modules_import_each_other():
    """Every import between two of our modules goes one way — also the ones inside functions, where cycles hide
    (a package and its own submodules aside: `__init__` re-exports them)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    mods = {}
    for folder, package in FOLDERS.items():
        for f in (root / folder).rglob("*.py"):
            name = ".".join((package, *f.relative_to(root / folder).with_suffix("").parts))
            mods[name.removesuffix(".__init__")] = f
    edges: dict[str, set[str]] = {}
    for name, f in mods.items():
        out = set()
        for node in ast.walk(ast.parse(f.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                           for a in node.names]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    out.add(t)
        edges[name] = out
    both = {tuple(sorted((a, b))) for a in edges for b in edges[a] if a in edges.get(b, ())}
    both = {(a, b) for a, b in both if not (b.startswith(a + ".") or a.startswith(b + "."))}
    assert sorted(both) == []
