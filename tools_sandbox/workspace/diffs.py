"""Applying a unified diff to a workspace's files from the host (no `git` or `patch` needed in the image).

Strict: every hunk's context and removed lines must match the file exactly (no fuzz, no offsets beyond the hunk's
own line numbers being wrong by what earlier hunks shifted); a mismatch names the file and the hunk.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from slime_env.errors import InvalidInput


class DiffError(InvalidInput):
    """A diff that does not parse or does not apply; the message names the file and hunk."""


async def apply_unified_diff(diff: str, *, read: Callable[[str], Awaitable[bytes | None]],
                             write: Callable[[str, bytes], Awaitable[None]],
                             delete: Callable[[str], Awaitable[None]]) -> list[str]:
    """Apply `diff` (paths `a/x` / `b/x` or plain, relative to the caller's root) through `read(path)` (None: no such
    file), `write(path, data)` and `delete(path)`; returns the paths changed. Nothing is written unless every file's
    hunks apply."""
    from unidiff import PatchSet
    from unidiff.errors import UnidiffParseError

    try:
        patch = PatchSet(diff)
    except UnidiffParseError as e:
        raise DiffError(f"the diff does not parse: {e}") from None
    if not patch:
        raise DiffError("the diff changes no file")
    results: list[tuple[str, bytes | None]] = []
    for pf in patch:
        path = _strip(pf.target_file if not pf.is_removed_file else pf.source_file)
        if pf.is_binary_file:
            raise DiffError(f"{path}: binary diffs are not supported")
        if pf.is_added_file:
            old_lines: list[str] = []
        else:
            data = await read(_strip(pf.source_file))
            if data is None:
                raise DiffError(f"{path}: the diff changes a file that does not exist")
            old_lines = data.decode("utf-8", "surrogateescape").splitlines(keepends=True)
        if pf.is_removed_file:
            results.append((path, None))
            continue
        new_lines, cursor = [], 0
        for n, hunk in enumerate(pf, 1):
            start = max(hunk.source_start - 1, 0)
            expected = [line.value for line in hunk if line.is_context or line.is_removed]
            if start < cursor or old_lines[start:start + len(expected)] != expected:
                if [x.rstrip("\n") for x in old_lines[start:start + len(expected)]] != \
                        [x.rstrip("\n") for x in expected]:
                    raise DiffError(f"{path}: hunk {n} (line {hunk.source_start}) does not match the file")
            new_lines += old_lines[cursor:start]
            new_lines += [line.value for line in hunk if line.is_context or line.is_added]
            cursor = start + len(expected)
        new_lines += old_lines[cursor:]
        results.append((path, "".join(new_lines).encode("utf-8", "surrogateescape")))
    for path, data in results:
        if data is None:
            await delete(path)
        else:
            await write(path, data)
    return [path for path, _ in results]


def _strip(name: str) -> str:
    return name[2:] if name.startswith(("a/", "b/")) else name
