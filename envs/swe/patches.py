"""Unified diffs of text files: `make_patch` writes one in git's shape (so `git apply` takes it), `apply_patch`
applies one exactly (every context and removed line must match: no fuzz), host-side, with no git involved."""

from __future__ import annotations

import difflib
import re

from slime_env.errors import InvalidInput

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(InvalidInput):
    """A patch is malformed or does not apply to the text it was given; the message names the file and hunk."""


def make_patch(path: str, old: str, new: str, *, context: int = 3) -> str:
    """The git-style unified diff that turns `old` into `new` (file `path`, relative to the repository)."""
    if not (old.endswith("\n") and new.endswith("\n")):
        raise InvalidInput(f"{path}: make_patch needs texts that end with a newline")
    body = difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                fromfile=f"a/{path}", tofile=f"b/{path}", n=context)
    text = "".join(body)
    return f"diff --git a/{path} b/{path}\n{text}" if text else ""


def patch_files(patch: str) -> list[str]:
    """The paths a patch changes (its `+++ b/...` lines)."""
    return [line[6:].rstrip("\n") for line in patch.splitlines() if line.startswith("+++ b/")]


def apply_patch(files: dict[str, str], patch: str, *, reverse: bool = False) -> dict[str, str]:
    """`files` (path -> text) with `patch` applied (or reversed); only the files it changes are returned."""
    out: dict[str, str] = {}
    for path, hunks in parse_patch(patch):
        if path not in files:
            raise PatchError(f"patch changes {path}, which is not among the files given")
        lines = files[path].splitlines(keepends=True)
        shift = 0
        for n, (old_start, new_start, old, new) in enumerate(hunks, 1):
            start = new_start if reverse else old_start
            if reverse:
                old, new = new, old
            at = (start - 1 if old else start) + shift
            if lines[at:at + len(old)] != old:
                raise PatchError(f"{path}: hunk {n} does not apply at line {start}")
            lines[at:at + len(old)] = new
            shift += len(new) - len(old)
        out[path] = "".join(lines)
    return out


def parse_patch(patch: str) -> list[tuple[str, list[tuple[int, int, list[str], list[str]]]]]:
    """A unified diff as [(path, hunks)], a hunk (old start, new start, old lines, new lines); `PatchError` if
    malformed."""
    files: list[tuple[str, list]] = []
    lines = patch.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("+++ b/"):
            files.append((line[6:].rstrip("\n"), []))
        elif line.startswith("@@"):
            m = _HUNK.match(line)
            if not m or not files:
                raise PatchError(f"malformed hunk header {line.rstrip()!r}")
            n_old = int(m[2]) if m[2] is not None else 1
            n_new = int(m[4]) if m[4] is not None else 1
            old: list[str] = []
            new: list[str] = []
            i += 1
            while i < len(lines) and (len(old) < n_old or len(new) < n_new):
                body = lines[i]
                tag, text = body[:1], body[1:]
                if tag == " ":
                    old.append(text)
                    new.append(text)
                elif tag == "-":
                    old.append(text)
                elif tag == "+":
                    new.append(text)
                elif tag == "\\":
                    pass
                else:
                    raise PatchError(f"{files[-1][0]}: malformed hunk line {body.rstrip()!r}")
                i += 1
            files[-1][1].append((int(m[1]), int(m[3]), old, new))
            continue
        i += 1
    if not files:
        raise PatchError("the patch changes no file")
    return files


def reverting_edits(patch: str) -> list[tuple[str, str, str]]:
    """`(path, old_str, new_str)` per hunk that undo `patch` as editor `str_replace` calls would: the hunk's text
    after the patch (context included, so a dropped line has an anchor) and before it. What a teacher that may read
    a task's `bug.patch` types; the student never sees the patch."""
    return [(path, "".join(new), "".join(old)) for path, hunks in parse_patch(patch) for _, _, old, new in hunks]
