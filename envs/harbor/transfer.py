"""Copy paths from one workspace into another, safely: what an isolated or separate verifier gets of the agent's
work (its workdir, or the task's artifacts).

The source side is packed by `tar` inside the agent's workspace (its processes killed first), so what comes out
is whatever the agent left — including, in a workspace where the agent was root, a `tar` it replaced. So the
archive is checked on the host before it reaches the verifier's workspace, as Harbor's artifact upload does with
tarfile's `data` filter: members stay under the copied path (no absolute names, no `..`), links point inside it
(a `..` may not climb through a link), hard links name earlier members, device files and fifos are dropped, and
setuid/setgid bits are cleared. The checked archive is unpacked in the fresh workspace by that workspace's own
`tar`, as root, keeping modes and numeric owners.

A link that leaves the copied path (a virtualenv's `bin/python3 -> /usr/local/bin/python3`) is not carried as a
link: `restore_links` makes it, in the fresh workspace, a copy of what its target is *there* (the fresh image's
file, never the agent's, which a root agent could have replaced). A copy, not a link, because the verifier may
write where the agent put a link: through a link to site-packages its output would become code the tests then run.
Targets that are missing there, too large, or in a place the verifier owns or that is not plain files (/tests,
/logs, /solution, /proc, /sys, /dev, /run, /tmp, the copied paths themselves) are dropped, and every drop is
reported.
"""

from __future__ import annotations

import io
import os
import posixpath
import shlex
import tarfile

from slime_env.tools_sandbox.workspace import Workspace, WorkspaceError

MAX_ARCHIVE_BYTES = 512 << 20
MAX_LINK_COPY_KB = 64 << 10   # what one restored link may copy (a venv's interpreter is a few MB at most)
MAX_OUTSIDE_LINKS = 256       # links restored per verification; a workdir of thousands is a forgery, not a venv
# Where a restored link may not lead: what the verifier itself writes or reads its verdict from, and kernel or
# per-run trees whose contents are not files of the image.
FORBIDDEN_TARGETS = ("/tests", "/logs", "/solution", "/proc", "/sys", "/dev", "/run", "/var/run", "/tmp", "/var/tmp")


def _tmp_name() -> str:
    return f"/tmp/.slime_env-copy-{os.urandom(8).hex()}.tar"


async def pack(ws: Workspace, path: str, *, exclude: tuple[str, ...] = ()) -> bytes | None:
    """A tar archive of `path` in `ws` (members named `basename(path)/...`), or None if `path` does not exist."""
    path = posixpath.normpath(path)
    if path == "/":
        raise WorkspaceError("refusing to copy the whole file system of a workspace")
    parent, base = posixpath.split(path)
    name = _tmp_name()
    argv = ["tar", "-C", parent, "-cf", name, *(f"--exclude={e}" for e in exclude), "--", base]
    script = (f"if [ -e {shlex.quote(path)} ] || [ -L {shlex.quote(path)} ]; then "
              f"{' '.join(map(shlex.quote, argv))}; else echo __missing__; fi")
    result = await ws.exec(script, user=0, timeout_s=300, cwd="/")
    if result.stdout.strip() == "__missing__":
        return None
    if result.status != "ok":
        raise WorkspaceError(f"could not pack {path} in workspace {ws.id}: {result.stderr.strip() or result.reason}")
    try:
        return await ws.read_file(name, max_bytes=MAX_ARCHIVE_BYTES)
    finally:
        await ws.exec(["rm", "-f", name], user=0, timeout_s=60, cwd="/")


def sanitize(data: bytes, path: str, *, outside: list[tuple[str, str, str]] | None = None
             ) -> tuple[bytes, list[str]]:
    """The archive `pack(path)` made, with only safe members (see the module); returns it and what was dropped.
    `outside`: if given, links that leave `path` are appended to it as (member name, container path, absolute
    target) for `restore_links` instead of being dropped (nothing under them is kept either way)."""
    path = posixpath.normpath(path)
    parent, base = posixpath.split(path)
    out, dropped = io.BytesIO(), []
    links: set[str] = set()   # container paths of symbolic links kept so far
    files: set[str] = set()   # member names of regular files kept so far
    with tarfile.open(fileobj=io.BytesIO(data)) as src, tarfile.open(fileobj=out, mode="w") as dst:
        for m in src:
            name = posixpath.normpath(m.name)
            if m.name.startswith("/") or ".." in m.name.split("/") or not (name == base or name.startswith(base + "/")):
                dropped.append(f"{m.name}: outside {path}")
                continue
            full = posixpath.join(parent, name)
            if _through_link(full, links, path):
                dropped.append(f"{m.name}: under a link")
                continue
            if m.issym():
                if not _link_inside(posixpath.dirname(full), m.linkname, links, path):
                    if outside is None:
                        dropped.append(f"{m.name}: link to {m.linkname} leaves {path}")
                    else:
                        links.add(full)  # what a crafted archive puts under it is dropped as under a link
                        outside.append((name, full, posixpath.normpath(posixpath.join(posixpath.dirname(full),
                                                                                    m.linkname))))
                    continue
                links.add(full)
            elif m.islnk():
                if posixpath.normpath(m.linkname) not in files:
                    dropped.append(f"{m.name}: hard link to {m.linkname}")
                    continue
            elif not (m.isfile() or m.isdir()):
                dropped.append(f"{m.name}: not a file, folder or link")
                continue
            kept = m.replace(name=name, mode=m.mode & 0o1777, deep=False)
            if m.isfile():
                files.add(name)
                dst.addfile(kept, src.extractfile(m))
            else:
                dst.addfile(kept)
    return out.getvalue(), dropped


def _through_link(full: str, links: set[str], root: str) -> bool:
    """Whether a parent folder of `full` (below `root`) is a link kept earlier: writing there would follow it."""
    p = posixpath.dirname(full)
    while len(p) > len(root):
        if p in links:
            return True
        p = posixpath.dirname(p)
    return full != root and root in links


def _link_inside(folder: str, target: str, links: set[str], root: str) -> bool:
    """Whether a link in `folder` to `target` stays inside `root`, resolving `..` only over non-links."""
    parts: list[str] = [] if target.startswith("/") else [p for p in folder.split("/") if p]
    for comp in target.split("/"):
        if comp in ("", "."):
            continue
        if comp == "..":
            if not parts or "/" + "/".join(parts) in links:
                return False
            parts.pop()
        else:
            parts.append(comp)
    resolved = "/" + "/".join(parts)
    return resolved == root or resolved.startswith(root.rstrip("/") + "/")


async def unpack(ws: Workspace, path: str, archive: bytes | None) -> None:
    """Make `path` in `ws` what the archive holds: removed first, then unpacked (nothing if `archive` is None)."""
    path = posixpath.normpath(path)
    parent = posixpath.dirname(path)
    script = f"rm -rf -- {shlex.quote(path)} && mkdir -p -- {shlex.quote(parent)}"
    name = None
    if archive is not None:
        name = _tmp_name()
        await ws.write_file(name, archive, mode=0o600)
        script += (f" && tar -C {shlex.quote(parent)} -xpf {shlex.quote(name)} --numeric-owner; rc=$?; "
                   f"rm -f {shlex.quote(name)}; exit $rc")
    result = await ws.exec(script, user=0, timeout_s=300, cwd="/")
    if result.status != "ok":
        raise WorkspaceError(f"could not unpack {path} in workspace {ws.id}: {result.stderr.strip() or result.reason}")


_RESTORE = r"""
restore() {  # $1 member name, $2 where the link was, $3 its target; one line per link dropped
  if [ -e "$2" ] || [ -L "$2" ]; then echo "$1: a link to $3, but the archive put something else there"; return; fi
  r=$(readlink -f -- "$3" 2>/dev/null)
  if [ -z "$r" ] || [ ! -e "$r" ]; then echo "$1: link to $3, which the verifier's workspace does not have"; return; fi
  case "$r" in $FORBIDDEN) echo "$1: link to $3 (resolves to $r, where the verifier may not follow)"; return;; esac
  if [ ! -f "$r" ] && [ ! -d "$r" ]; then echo "$1: link to $3, not a file or folder"; return; fi
  kb=$(du -sk -- "$r" 2>/dev/null | cut -f1)
  if [ -z "$kb" ] || [ "$kb" -gt $LIMIT ]; then echo "$1: link to $3, too large to copy (${kb:-?} KB)"; return; fi
  cp -a -- "$r" "$2" 2>/dev/null || { rm -rf -- "$2"; echo "$1: link to $3 could not be copied"; }
}
"""


async def restore_links(ws: Workspace, links: list[tuple[str, str, str]], *, roots: tuple[str, ...] = ()
                        ) -> list[str]:
    """Make each link that `sanitize` set aside (`outside`) a copy of its target in `ws` (see the module), after
    the archives are unpacked there; `roots`: the copied paths, which a target may not lead back into (the agent
    wrote them). Returns what was dropped, one line each."""
    dropped = [f"{name}: link to {target}: more than {MAX_OUTSIDE_LINKS} links leave the copied paths"
               for name, _, target in links[MAX_OUTSIDE_LINKS:]]
    links = links[:MAX_OUTSIDE_LINKS]
    if not links:
        return dropped
    # `case` patterns: each forbidden tree and everything under it; "/" itself (the whole file system)
    trees = [t for t in (*FORBIDDEN_TARGETS, *roots) if t not in ("", "/")]
    pattern = "|".join(["/", *(f"{shlex.quote(t)}|{shlex.quote(t)}/*" for t in trees)])
    script = (_RESTORE.replace("$FORBIDDEN", pattern).replace("$LIMIT", str(MAX_LINK_COPY_KB))
              + "\n".join(f"restore {' '.join(shlex.quote(x) for x in link)}" for link in links))
    result = await ws.exec(["sh", "-c", script], user=0, timeout_s=300, cwd="/")
    if result.status != "ok":
        raise WorkspaceError(f"could not restore links in workspace {ws.id}: {result.stderr.strip() or result.reason}")
    return dropped + [line for line in result.stdout.splitlines() if line.strip()]


async def copy_path(src: Workspace, dst: Workspace, path: str, *, exclude: tuple[str, ...] = ()) -> list[str]:
    """Copy `path` from `src` to the same path in `dst` (see the module); returns the members dropped as unsafe."""
    archive = await pack(src, path, exclude=exclude)
    dropped: list[str] = []
    if archive is not None:
        archive, dropped = sanitize(archive, path)
    await unpack(dst, path, archive)
    return dropped
