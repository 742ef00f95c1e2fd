"""The kinds of terminal task: each makes a seeded instance (the files the agent starts from, its instruction, what
the verifier checks) and knows the scripted solution (the teacher's bash commands).

A kind is a small class with `make(rng) -> Instance` and `solve(fields, last_output) -> commands`; `KINDS` maps
names to kinds. Instructions are one templated sentence per kind (its `pattern` reads the fields back, so the
teacher needs only the conversation's text); every path is absolute under `WORKDIR`. Checks are data
(`Instance.checks`, read by `verifier_check.py` in the verifier's fresh workspace): the verdict is the final file
system, never what the agent printed.
"""

from __future__ import annotations

import builtins
import keyword
import random
import re
from dataclasses import dataclass, field
from typing import Any

WORKDIR = "/app"
ANSWER = f"{WORKDIR}/answer.txt"

_WORDS = ("apple", "river", "stone", "cloud", "maple", "tiger", "lemon", "piano", "rocket", "garden", "silver",
          "window", "forest", "candle", "pepper", "ocean", "violet", "copper", "meadow", "falcon", "harbor", "pencil",
          "orange", "castle", "button", "marble", "thunder", "willow", "basket", "mirror")
_NAMES = ("notes", "report", "todo", "draft", "summary", "config", "inventory", "journal", "recipes", "tasks",
          "ideas", "budget", "events", "contacts", "letters", "records")
_DIRS = ("docs", "data", "logs", "src", "archive", "inbox", "work", "files")
_EXTS = ("txt", "log", "md", "csv")


@dataclass(frozen=True)
class Instance:
    """One task: `files` (path under WORKDIR -> text) the agent starts from, the `instruction`, the verifier's
    `checks` (see verifier_check.py), the kind's `fields` (what the instruction names) and the scripted
    `solution` (bash commands, in order)."""

    kind: str
    instruction: str
    files: dict[str, str]
    checks: list[dict[str, Any]]
    fields: dict[str, str] = field(default_factory=dict)
    solution: tuple[str, ...] = ()


def _line(rng: random.Random, n: int = 4) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, n)))


def _lines(rng: random.Random, lo: int = 3, hi: int = 12, avoid: str = "") -> list[str]:
    out, n = [], rng.randint(lo, hi)
    while len(out) < n:
        line = _line(rng)
        if not avoid or avoid not in line:
            out.append(line)
    return out


def _text(lines: list[str]) -> str:
    return "".join(f"{line}\n" for line in lines)


def _file(rng: random.Random, ext: str | None = None) -> str:
    return f"{rng.choice(_NAMES)}.{ext or rng.choice(_EXTS)}"


def _distractors(rng: random.Random, files: dict[str, str], folder: str = "", k: int = 2, avoid: str = "") -> None:
    for _ in range(k):
        name = f"{folder}/{_file(rng)}" if folder else _file(rng)
        files.setdefault(name, _text(_lines(rng, avoid=avoid)))


def _abs(rel: str) -> str:
    return f"{WORKDIR}/{rel}"


class Kind:
    """A task kind: `name`, the instruction `template` (fields in braces), `make(rng)`, `solve(fields, output)`."""

    name = ""
    template = ""
    steps = 1  # commands before submit in the scripted solution

    def make(self, rng: random.Random) -> Instance:
        raise NotImplementedError

    def solve(self, fields: dict[str, str], step: int, last_output: str) -> str | None:
        """The teacher's bash command for `step` (0-based) of the solution, given the last command's output; None
        when the work is done (then it submits)."""
        raise NotImplementedError

    @property
    def pattern(self) -> re.Pattern[str]:
        """The template as a regex whose named groups are the fields (each a run of characters other than blanks and
        `<`, where a chat template's markers begin)."""
        parts = re.split(r"\{(\w+)\}", self.template)
        regex = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>[^\\s<]+)" for i, p in enumerate(parts))
        return re.compile(regex)

    def instance(self, files: dict[str, str], checks: list[dict[str, Any]], hint: str = "", **fields: str) -> Instance:
        """The instance; its solution is `solve` played with `hint` as every command's output."""
        solution: list[str] = []
        while (command := self.solve(fields, len(solution), hint)) is not None:
            solution.append(command)
        return Instance(self.name, self.template.format(**fields), files, checks, dict(fields), tuple(solution))


class CountLines(Kind):
    name = "count_lines"
    template = "Count the lines in {path} and write the number to /app/answer.txt."

    def make(self, rng):
        rel = f"{rng.choice(_DIRS)}/{_file(rng)}"
        lines = _lines(rng, 2, 15)
        files = {rel: _text(lines)}
        _distractors(rng, files, rel.split("/")[0])
        return self.instance(files, [{"answer": ANSWER, "accept": [str(len(lines))]}], path=_abs(rel))

    def solve(self, fields, step, last_output):
        return f"wc -l < {fields['path']} > {ANSWER}" if step == 0 else None


class CountFiles(Kind):
    name = "count_files"
    template = "Count the files in the folder {folder} and write the number to /app/answer.txt."

    def make(self, rng):
        folder = rng.choice(_DIRS)
        files: dict[str, str] = {}
        for _ in range(rng.randint(1, 9)):
            files.setdefault(f"{folder}/{_file(rng)}", _text(_lines(rng)))
        _distractors(rng, files, rng.choice([d for d in _DIRS if d != folder]))
        count = sum(1 for p in files if p.startswith(folder + "/"))
        return self.instance(files, [{"answer": ANSWER, "accept": [str(count)]}], folder=_abs(folder))

    def solve(self, fields, step, last_output):
        return f"ls {fields['folder']} | wc -l > {ANSWER}" if step == 0 else None


class FindWord(Kind):
    name = "find_word"
    template = ("One file in the folder {folder} contains the word {word}. "
                "Write the path of that file to /app/answer.txt.")

    def make(self, rng):
        folder, word = rng.choice(_DIRS), f"{rng.choice(_WORDS)}{rng.randint(10, 99)}"
        files: dict[str, str] = {}
        while len(files) < rng.randint(3, 6):
            files.setdefault(f"{folder}/{_file(rng)}", _text(_lines(rng)))
        target = rng.choice(sorted(files))
        lines = files[target].splitlines()
        lines.insert(rng.randint(0, len(lines)), f"{_line(rng, 2)} {word} {_line(rng, 2)}")
        files[target] = _text(lines)
        accept = [_abs(target), target, f"./{target}"]
        return self.instance(files, [{"answer": ANSWER, "accept": accept}], folder=_abs(folder), word=word)

    def solve(self, fields, step, last_output):
        return f"grep -rl {fields['word']} {fields['folder']} > {ANSWER}" if step == 0 else None


class Rename(Kind):
    name = "rename"
    template = "Rename the file {src} to {dst}."

    def make(self, rng):
        src = _file(rng)
        dst = _file(rng)
        while dst == src:
            dst = _file(rng)
        files = {src: _text(_lines(rng))}
        _distractors(rng, files, rng.choice(_DIRS))
        return self.instance(files, [{"file": _abs(dst), "text": files[src]}, {"absent": _abs(src)}],
                             src=_abs(src), dst=_abs(dst))

    def solve(self, fields, step, last_output):
        return f"mv {fields['src']} {fields['dst']}" if step == 0 else None


class Replace(Kind):
    name = "replace"
    template = "In the file {path}, replace every {old} with {new}."

    def make(self, rng):
        rel = f"{rng.choice(_DIRS)}/{_file(rng)}"
        old, new = rng.sample(_WORDS, 2)
        lines = _lines(rng, 3, 10, avoid=new)
        for i in rng.sample(range(len(lines)), k=rng.randint(1, min(3, len(lines)))):
            lines[i] = f"{lines[i]} {old}"
        text = _text(lines)
        files = {rel: text}
        _distractors(rng, files, rel.split("/")[0])
        fixed = re.sub(rf"{old}", new, text)
        return self.instance(files, [{"file": _abs(rel), "text": fixed}], path=_abs(rel), old=old, new=new)

    def solve(self, fields, step, last_output):
        return f"sed -i 's/{fields['old']}/{fields['new']}/g' {fields['path']}" if step == 0 else None


class Create(Kind):
    name = "create"
    template = "Create the file {path} containing the single line {text} and nothing else."

    def make(self, rng):
        rel = f"{rng.choice(_DIRS)}/{_file(rng, 'txt')}"
        text = "-".join(rng.sample(_WORDS, 2)) + str(rng.randint(1, 99))
        files: dict[str, str] = {}
        _distractors(rng, files, rel.split("/")[0])
        files.pop(rel, None)
        files.setdefault(f"{rel.split('/')[0]}/{rng.choice(_NAMES)}.log", _text(_lines(rng)))  # the folder exists
        return self.instance(files, [{"file": _abs(rel), "text": text + "\n"}], path=_abs(rel), text=text)

    def solve(self, fields, step, last_output):
        return f"echo {fields['text']} > {fields['path']}" if step == 0 else None


class DeleteExt(Kind):
    name = "delete_ext"
    template = "Delete every .{ext} file in the folder {folder} and keep the other files."

    def make(self, rng):
        folder, ext = rng.choice(_DIRS), rng.choice(_EXTS)
        files: dict[str, str] = {}
        for _ in range(rng.randint(1, 3)):
            files.setdefault(f"{folder}/{_file(rng, ext)}", _text(_lines(rng)))
        for _ in range(rng.randint(1, 3)):
            files.setdefault(f"{folder}/{_file(rng, rng.choice([e for e in _EXTS if e != ext]))}",
                             _text(_lines(rng)))
        checks = [{"absent": _abs(p)} if p.endswith("." + ext) else {"file": _abs(p), "text": t}
                  for p, t in sorted(files.items())]
        return self.instance(files, checks, folder=_abs(folder), ext=ext)

    def solve(self, fields, step, last_output):
        return f"rm {fields['folder']}/*.{fields['ext']}" if step == 0 else None


class LineN(Kind):
    name = "line_n"
    template = "Write line {n} of {path} to /app/answer.txt."

    def make(self, rng):
        rel = f"{rng.choice(_DIRS)}/{_file(rng)}"
        lines = _lines(rng, 4, 12)
        n = rng.randint(1, len(lines))
        files = {rel: _text(lines)}
        return self.instance(files, [{"answer": ANSWER, "accept": [lines[n - 1]]}], n=str(n), path=_abs(rel))

    def solve(self, fields, step, last_output):
        return f"sed -n {fields['n']}p {fields['path']} > {ANSWER}" if step == 0 else None


# builtins whose one-character misspelling the fix_typo scripts carry, and a script line using each
_CALLS = {"print": "print({expr})", "len": "print(len({seq}))", "sum": "print(sum({seq}))",
          "sorted": "print(sorted({seq}))", "max": "print(max({seq}))", "min": "print(min({seq}))"}
_TYPO = re.compile(r"name '(\w+)' is not defined")


def _near(typo: str) -> list[str]:
    return [n for n in _CALLS if len(n) == len(typo) and sum(a != b for a, b in zip(n, typo)) == 1]


def _misspell(rng: random.Random, name: str) -> str:
    """`name` with one letter changed: not a builtin or keyword, and one substitution from no other `_CALLS` name
    (so the fix is unambiguous)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    while True:
        i = rng.randrange(len(name))
        typo = name[:i] + rng.choice(letters.replace(name[i], "")) + name[i + 1:]
        if not hasattr(builtins, typo) and not keyword.iskeyword(typo) and _near(typo) == [name]:
            return typo


def nearest_builtin(typo: str) -> str:
    """The `_CALLS` builtin one substitution away from `typo` ('print' if none is)."""
    near = _near(typo)
    return near[0] if near else "print"


class FixTypo(Kind):
    name = "fix_typo"
    template = "The Python script {path} fails. Fix the one-letter typo in it so that it runs."
    steps = 2

    def make(self, rng):
        rel = f"{rng.choice(['src', 'work', 'files'])}/{rng.choice(_NAMES)}.py"
        values = [rng.randint(1, 50) for _ in range(rng.randint(3, 6))]
        var = rng.choice(["values", "numbers", "items", "scores", "counts"])
        lines = [f"{var} = {values}"]
        broken_name = rng.choice(sorted(_CALLS))
        body = [_CALLS[broken_name].format(expr=repr(_line(rng, 2)) if broken_name == "print" else var, seq=var)]
        body += [_CALLS[n].format(expr=f"'{rng.choice(_WORDS)}'", seq=var)
                 for n in rng.sample([n for n in _CALLS if n != broken_name], 1)]
        rng.shuffle(body)
        lines += body
        fixed = _text(lines)
        target = next(i for i, line in enumerate(lines) if line.startswith(f"{broken_name}(") or
                      f"({broken_name}(" in line)
        old = lines[target]
        while True:  # a typo found nowhere else in the script ('rin' is in 'print'), so one sed fixes it alone
            typo = _misspell(rng, broken_name)
            line = old.replace(f"{broken_name}(", f"{typo}(", 1) if old.startswith(f"{broken_name}(") \
                else old.replace(f"({broken_name}(", f"({typo}(", 1)
            broken = _text(lines[:target] + [line] + lines[target + 1:])
            if broken.count(typo) == 1:
                break
        return self.instance({rel: broken}, [{"file": _abs(rel), "text": fixed}],
                             hint=f"NameError: name '{typo}' is not defined", path=_abs(rel))

    def solve(self, fields, step, last_output):
        if step == 0:
            return f"python3 {fields['path']}"
        m = _TYPO.search(last_output)
        if step == 1 and m:  # the name Python says is not defined, back to the builtin it misspells
            return f"sed -i 's/{m.group(1)}(/{nearest_builtin(m.group(1))}(/' {fields['path']}"
        return None


# held-out kinds: never in training data by default; each is a neighbour of a training kind
class MoveInto(Kind):
    name = "move_into"
    template = "Move the file {src} into the folder {folder}."

    def make(self, rng):
        src, folder = _file(rng, "txt"), rng.choice(_DIRS)
        files = {src: _text(_lines(rng)), f"{folder}/{rng.choice(_NAMES)}.log": _text(_lines(rng))}
        return self.instance(files, [{"file": _abs(f"{folder}/{src}"), "text": files[src]}, {"absent": _abs(src)}],
                             src=_abs(src), folder=_abs(folder))

    def solve(self, fields, step, last_output):
        return f"mv {fields['src']} {fields['folder']}/" if step == 0 else None


class CountMatches(Kind):
    name = "count_matches"
    template = "Count the lines in {path} that contain the word {word} and write the number to /app/answer.txt."

    def make(self, rng):
        rel = f"{rng.choice(_DIRS)}/{_file(rng)}"
        word = rng.choice(_WORDS)
        lines = _lines(rng, 4, 12, avoid=word)
        hits = rng.sample(range(len(lines)), k=rng.randint(1, len(lines) - 1))
        for i in hits:
            lines[i] = f"{lines[i]} {word}"
        return self.instance({rel: _text(lines)}, [{"answer": ANSWER, "accept": [str(len(hits))]}],
                             path=_abs(rel), word=word)

    def solve(self, fields, step, last_output):
        return f"grep -c {fields['word']} {fields['path']} > {ANSWER}" if step == 0 else None


class CopyFile(Kind):
    name = "copy_file"
    template = "Copy the file {src} to {dst} and keep the original."

    def make(self, rng):
        src, dst = _file(rng, "txt"), f"{rng.choice(_DIRS)}/{_file(rng, 'md')}"
        text = _text(_lines(rng))
        files = {src: text, f"{dst.split('/')[0]}/{rng.choice(_NAMES)}.log": _text(_lines(rng))}
        return self.instance(files, [{"file": _abs(dst), "text": text}, {"file": _abs(src), "text": text}],
                             src=_abs(src), dst=_abs(dst))

    def solve(self, fields, step, last_output):
        return f"cp {fields['src']} {fields['dst']}" if step == 0 else None


class AppendLine(Kind):
    name = "append_line"
    template = "Add the line {text} at the end of {path}."

    def make(self, rng):
        rel = f"{rng.choice(_DIRS)}/{_file(rng)}"
        text = "-".join(rng.sample(_WORDS, 2)) + str(rng.randint(1, 99))
        before = _text(_lines(rng))
        return self.instance({rel: before}, [{"file": _abs(rel), "text": before + text + "\n"}],
                             text=text, path=_abs(rel))

    def solve(self, fields, step, last_output):
        return f"echo {fields['text']} >> {fields['path']}" if step == 0 else None


KINDS: dict[str, Kind] = {k.name: k for k in (CountLines(), CountFiles(), FindWord(), Rename(), Replace(), Create(),
                                              DeleteExt(), LineN(), FixTypo(), MoveInto(), CountMatches(), CopyFile(),
                                              AppendLine())}
HELDOUT_KINDS = ("move_into", "count_matches", "copy_file", "append_line")
TRAIN_KINDS = tuple(k for k in KINDS if k not in HELDOUT_KINDS)


def make_instance(kind: str, seed: int) -> Instance:
    """The instance of `kind` for `seed` (the same pair always gives the same instance)."""
    if kind not in KINDS:
        from slime_env.errors import InvalidInput

        raise InvalidInput(f"unknown terminal task kind {kind!r}; the kinds are {sorted(KINDS)}")
    return KINDS[kind].make(random.Random(f"{kind}:{seed}"))


def parse_instruction(text: str) -> tuple[Kind, dict[str, str]] | None:
    """The kind and fields of the last instruction in `text` (a conversation), or None if it holds none."""
    best = None
    for kind in KINDS.values():
        for m in kind.pattern.finditer(text):
            if best is None or m.start() > best[2]:
                best = (kind, m.groupdict(), m.start())
    return None if best is None else (best[0], best[1])
