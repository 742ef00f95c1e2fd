"""mkdocs hooks: links from the docs to files of the repository (examples, tests, bench) keep working, and the API
reference finds `slime_env.envs`, `slime_env.agents`, ... where the repository keeps them (top-level folders).

The pages link to `../examples/tool_env.py` and the like, which are outside `docs/`. The hook copies each
linked file into the site under `_src/` and points the link there, so the built site (which may be opened
offline) shows the file, and `--strict` still fails on a link to a file that does not exist.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
# The import layout of the installed package, as symlinks: mkdocstrings reads the sources statically from `paths`
# (mkdocs.yml), and the folders envs/, agents/, ... install as slime_env.envs, slime_env.agents, ...
API_SRC = ROOT / "build" / "api-src"


def _package_view() -> None:
    view = API_SRC / "slime_env"
    if view.is_dir() and not view.is_symlink():
        for entry in view.iterdir():
            entry.unlink()
    view.mkdir(parents=True, exist_ok=True)
    for entry in (ROOT / "slime_env").iterdir():
        (view / entry.name).symlink_to(entry)
    for folder in ("envs", "agents", "tools_sandbox", "trainers"):
        (view / folder).symlink_to(ROOT / folder)


_package_view()  # at import, before mkdocstrings reads its first page
_LINK = re.compile(r"\]\((\.\./[^)#\s]+)(#[^)\s]*)?\)")


def _targets(markdown: str, page_dir: str) -> list[tuple[str, str]]:
    out = []
    for match in _LINK.finditer(markdown):
        rel = posixpath.normpath(posixpath.join("docs", page_dir, match.group(1)))
        if not rel.startswith("..") and not rel.startswith("docs/") and (ROOT / rel).is_file():
            out.append((match.group(1), rel))
    return out


def on_files(files, config):
    docs = Path(config["docs_dir"])
    for page in docs.rglob("*.md"):
        page_dir = posixpath.dirname(page.relative_to(docs).as_posix())
        for _, rel in _targets(page.read_text(encoding="utf-8"), page_dir):
            uri = f"_src/{rel}"
            if files.get_file_from_path(uri) is None:
                files.append(File.generated(config, uri, abs_src_path=str(ROOT / rel)))
    return files


def on_page_markdown(markdown, page, config, files):
    page_dir = posixpath.dirname(page.file.src_uri)
    for link, rel in _targets(markdown, page_dir):
        markdown = markdown.replace(f"]({link}", f"]({posixpath.relpath('_src/' + rel, page_dir or '.')}")
    return markdown
