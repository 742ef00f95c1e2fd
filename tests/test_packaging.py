"""One distribution, one import name: the repository's folders install as `slime_env`, `slime_env.envs`,
`slime_env.agents`, `slime_env.tools_sandbox` and `slime_env.trainers`; the core never imports the other four, nor
the core's base its upper layer; no private name is imported across packages; a built wheel holds `slime_env/` alone
at its top, and its `slime-env` command works in a venv of its own."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"slime_env": "slime_env", "envs": "slime_env.envs", "agents": "slime_env.agents",
           "tools_sandbox": "slime_env.tools_sandbox", "trainers": "slime_env.trainers"}
OUTER = ("slime_env.envs", "slime_env.agents", "slime_env.tools_sandbox", "slime_env.trainers")
# Core modules that may import the outer packages, inside functions only: the application layer (the CLI), and the
# slime plug-in's engine client until the HTTP clients move into the core.
LAZY_OUTER_IMPORTS = {"slime_env/cli.py"}


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_listed_and_mapped_under_slime_env():
    on_disk = set()
    for folder, package in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            on_disk.add(".".join((package, *init.parent.relative_to(ROOT / folder).parts)))
    config = _setuptools()
    assert set(config["packages"]) == on_disk
    assert config["package-dir"] == {package: folder for folder, package in FOLDERS.items()}


def _imports(tree: ast.AST) -> list[tuple[str, bool]]:
    """(module imported, whether the import sits inside a function) for every import in `tree`."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((a.name, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.extend((f"{child.module}.{a.name}", in_function) for a in child.names)
            visit(child, nested)

    visit(tree, False)
    return found


def test_the_core_never_imports_the_outer_packages():
    """Walks every import of every core module, those inside functions included; only the CLI reaches outward."""
    bad, walked = [], 0
    for f in sorted((ROOT / "slime_env").rglob("*.py")):
        rel = str(f.relative_to(ROOT))
        for module, in_function in _imports(ast.parse(f.read_text())):
            walked += 1
            outer = module.split(".")[0] in ("envs", "agents", "tools_sandbox", "trainers") or \
                any(module == p or module.startswith(p + ".") for p in OUTER)
            if outer and not (rel in LAZY_OUTER_IMPORTS and in_function):
                bad.append(f"{rel}: {module}")
    assert walked > 500
    assert bad == []


# The core's upper layer: what runs episodes at scale or serves them (rollout, gateway), the edge (integrations,
# viewer) and the application (CLI, demo). The rest of the core is the base they stand on, and never imports them
# (env.py once reached up into rollout/ for its task files). AgentEnv's GatewayPool starts gateways, inside a function.
UPPER = ("slime_env.rollout", "slime_env.gateway", "slime_env.integrations", "slime_env.viewer", "slime_env.cli",
         "slime_env.demo", "slime_env.__main__")
LAZY_UPWARD_IMPORTS = {"slime_env/agent_env.py"}


def _module_name(f: Path) -> str:
    for folder, package in FOLDERS.items():
        if f.is_relative_to(ROOT / folder):
            return ".".join((package, *f.relative_to(ROOT / folder).with_suffix("").parts)).removesuffix(".__init__")
    raise ValueError(f)


def _is_in(module: str, roots: tuple[str, ...]) -> bool:
    return any(module == r or module.startswith(r + ".") for r in roots)


def test_the_core_never_imports_upward():
    """A base module of the core (types, env, ledger, runner, renderers, parsers, ...) imports no upper one."""
    bad, walked = [], 0
    for f in sorted((ROOT / "slime_env").rglob("*.py")):
        name = _module_name(f)
        if name == "slime_env" or _is_in(name, UPPER):
            continue  # the package's top re-exports both layers
        rel = str(f.relative_to(ROOT))
        for module, in_function in _imports(ast.parse(f.read_text())):
            walked += 1
            if _is_in(module, UPPER) and not (rel in LAZY_UPWARD_IMPORTS and in_function):
                bad.append(f"{rel}: {module}")
    assert walked > 300
    assert bad == []


# Private names still imported across packages, left to the trainers' rewrite (issue 55 items 1, 2, 4).
KNOWN_PRIVATE_IMPORTS: set[str] = set()  # none left; a new one fails


def test_no_private_name_is_imported_across_packages():
    """`from a.b import _name` where a.b is not in the importer's own package: a name other packages need is public
    (or the helper moves to where it belongs). A package's modules never import names its `__init__` defines either:
    the `__init__` imports them, so at import time they would find the package half loaded."""
    bad, modules, packages = [], _modules(), _packages()
    for folder in FOLDERS:
        for f in sorted((ROOT / folder).rglob("*.py")):
            name, tree = _module_name(f), ast.parse(f.read_text())
            package = name if f.name == "__init__.py" else name.rpartition(".")[0]
            for node in ast.walk(tree):
                if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                        and node.module.startswith("slime_env")):
                    continue
                source_package = node.module if node.module in packages else node.module.rpartition(".")[0]
                for alias in node.names:
                    where = f"{f.relative_to(ROOT)}: {node.module}.{alias.name}"
                    private = alias.name.startswith("_") and not alias.name.startswith("__")
                    if private and source_package != package and where not in KNOWN_PRIVATE_IMPORTS:
                        bad.append(where)
                    if node in tree.body and node.module == package and f.name != "__init__.py" and \
                            f"{package}.{alias.name}" not in modules:
                        bad.append(f"{where} (from its own package's __init__, at import time)")
    assert bad == []


def _modules() -> set[str]:
    return {_module_name(f) for folder in FOLDERS for f in (ROOT / folder).rglob("*.py")}


def _packages() -> set[str]:
    return {_module_name(f) for folder in FOLDERS for f in (ROOT / folder).rglob("__init__.py")}


def test_no_module_of_ours_imports_a_top_level_folder_name():
    """`envs.x`, `agents.x`, ... are the spelling before one import name: nothing of ours may still use it."""
    bad = []
    for folder in FOLDERS:
        for f in (ROOT / folder).rglob("*.py"):
            for module, _ in _imports(ast.parse(f.read_text())):
                if module.split(".")[0] in ("envs", "agents", "tools_sandbox", "trainers"):
                    bad.append(f"{f.relative_to(ROOT)}: {module}")
    assert bad == []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, timeout=600)
    (whl,) = out.glob("slime_env-*.whl")
    return whl


def test_the_wheel_holds_slime_env_alone_at_its_top(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"slime_env", next(t for t in tops if t.endswith(".dist-info"))}
    for needed in ("slime_env/envs/code/env.py", "slime_env/agents/engine.py", "slime_env/tools_sandbox/docker_pool.py",
                   "slime_env/trainers/megatron/model.py", "slime_env/trainers/configs/demo.yaml",
                   "slime_env/chat_templates/qwen3.jinja", "slime_env/viewer/viewer.js",
                   "slime_env/tools_sandbox/workspace/agent.c"):
        assert needed in names, needed
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert ("= envs." not in entry_points and "= agents." not in entry_points
            and "slime_env.envs.code.env" in entry_points)


def test_slime_env_and_every_subcommand_run_from_the_wheel_in_a_venv_of_its_own(wheel, tmp_path):
    """A venv with the wheel alone (its dependencies come from this interpreter's site-packages, added behind it by a
    .pth file, so the editable install's finder is not there); run from an empty folder."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True, timeout=600)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(args, capture_output=True, text=True, cwd=cwd, env=env, timeout=300)

    where = run(str(py), "-c", "import slime_env, slime_env.envs, slime_env.agents, slime_env.tools_sandbox, "
                               "slime_env.trainers, importlib.util as u; print(slime_env.__file__); "
                               "print([n for n in ('envs', 'trainers', 'tools_sandbox') if u.find_spec(n)])")
    assert where.returncode == 0, where.stderr
    assert where.stdout.splitlines() == [str(site / "slime_env" / "__init__.py"), "[]"]
    # Every command path of the CLI the wheel installed (groups' subcommands included), read from its click tree.
    listed = run(str(py), "-c", LIST_COMMANDS)
    assert listed.returncode == 0, listed.stderr
    paths = [line.split() for line in listed.stdout.splitlines()]
    assert ({("train",), ("serve-engine",), ("sandbox", "build-image"), ("search", "build-index")}
            <= set(map(tuple, paths)))
    cli = str(env_dir / "bin" / "slime-env")
    assert "train" in run(cli, "--help").stdout
    for path in paths:
        out = run(cli, *path, "--help")
        assert out.returncode == 0 and "Usage" in out.stdout, (path, out.stdout[-500:], out.stderr[-2000:])


LIST_COMMANDS = """
import typer.main
from slime_env import cli
cli._register_package_commands()
def walk(cmd, path):
    if getattr(cmd, "commands", None):
        for name, sub in cmd.commands.items():
            walk(sub, path + [name])
    else:
        print(" ".join(path))
walk(typer.main.get_command(cli.app), [])
"""
