"""The kinds of terminal task: each makes a seeded instance (the files the agent starts from, its instruction, what
the verifier checks) and knows the scripted solution (the teacher's bash commands).

A kind is a small class with `make(rng) -> Instance` and `solve(fields, last_output) -> commands`; `KINDS` maps
names to kinds. A train kind's instruction is one of several paraphrased templates (drawn per instance), so a model
learns what the words ask for rather than one sentence per command; a held-out kind has one template, never trained
on. Each template's regex reads the fields back, so the teacher needs only the conversation's text; every path is
absolute under `WORKDIR`. Checks are data
(`Instance.checks`, read by `verifier_check.py` in the verifier's fresh workspace): the verdict is the final file
system, never what the agent printed.
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
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
    """A task kind: `name`, its instruction `templates` (fields in braces; every template names the same fields),
    `make(rng)`, `solve(fields, step, output)`."""

    name = ""
    templates: tuple[str, ...] = ()
    steps = 1  # commands before submit in the scripted solution

    @property
    def template(self) -> str:
        """The first (canonical) template."""
        return self.templates[0]

    def make(self, rng: random.Random) -> Instance:
        raise NotImplementedError

    def solve(self, fields: dict[str, str], step: int, last_output: str) -> str | None:
        """The teacher's bash command for `step` (0-based) of the solution, given the last command's output; None
        when the work is done (then it submits)."""
        raise NotImplementedError

    @functools.cached_property
    def patterns(self) -> tuple[re.Pattern[str], ...]:
        """Each template as a regex whose named groups are the fields (each a run of characters other than blanks and
        `<`, where a chat template's markers begin)."""
        out = []
        for template in self.templates:
            parts = re.split(r"\{(\w+)\}", template)
            out.append(re.compile("".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>[^\\s<]+)"
                                          for i, p in enumerate(parts))))
        return tuple(out)

    def instance(self, files: dict[str, str], checks: list[dict[str, Any]], hint: str = "", **fields: str) -> Instance:
        """The instance; its solution is `solve` played with `hint` as every command's output."""
        solution: list[str] = []
        while (command := self.solve(fields, len(solution), hint)) is not None:
            solution.append(command)
        return Instance(self.name, self.template.format(**fields), files, checks, dict(fields), tuple(solution))


class CountLines(Kind):
    name = "count_lines"
    templates = ("Count the lines in {path} and write the number to /app/answer.txt.",
                 "How many lines does {path} have? Write the number to /app/answer.txt.",
                 "Write the number of lines in {path} to /app/answer.txt.",
                 "Find out how many lines the file {path} has and put that number in /app/answer.txt.")

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
    templates = ("Count the files in the folder {folder} and write the number to /app/answer.txt.",
                 "How many files are in {folder}? Write the number to /app/answer.txt.",
                 "Write the number of files in the folder {folder} to /app/answer.txt.",
                 "Put the count of files inside {folder} in /app/answer.txt.")

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
    templates = ("One file in the folder {folder} contains the word {word}. Write the path of that file to "
                 "/app/answer.txt.",
                 "Which file in {folder} contains {word}? Write its path to /app/answer.txt.",
                 "Find the file under {folder} that mentions {word} and write its path to /app/answer.txt.",
                 "Search the folder {folder} for the word {word} and put the path of the file that has it in "
                 "/app/answer.txt.")

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
    templates = ("Rename the file {src} to {dst}.",
                 "Move the file {src} to {dst}.",
                 "Change the name of {src} to {dst}.",
                 "Give the file {src} the new name {dst}.")

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
    templates = ("In the file {path}, replace every {old} with {new}.",
                 "Replace each {old} in {path} with {new}.",
                 "Change every {old} to {new} in the file {path}.",
                 "In {path}, swap every occurrence of {old} for {new}.")

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
    templates = ("Create the file {path} containing the single line {text} and nothing else.",
                 "Make a new file {path} whose only line is {text}.",
                 "Write {text} into a new file {path}, as its one line.",
                 "Create {path} with the one line {text} in it.")

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
    templates = ("Delete every .{ext} file in the folder {folder} and keep the other files.",
                 "Remove all the .{ext} files from {folder}, leaving the rest.",
                 "In the folder {folder}, delete the .{ext} files only.",
                 "Get rid of the .{ext} files in {folder} but not the others.")

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
    templates = ("Write line {n} of {path} to /app/answer.txt.",
                 "What is line {n} of the file {path}? Write it to /app/answer.txt.",
                 "Put the text of line {n} of {path} in /app/answer.txt.",
                 "Save line number {n} of {path} to /app/answer.txt.")

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
    templates = ("The Python script {path} fails. Fix the one-letter typo in it so that it runs.",
                 "Running {path} with python3 fails on a misspelt name. Fix the typo so that it runs.",
                 "The script {path} has a one-letter typo that stops it from running. Fix it.",
                 "Make the Python file {path} run again: one name in it is misspelt by one letter.")
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


# train kinds that teach, in other contexts, the primitives the held-out kinds compose: cp (a backup), echo >> (a
# log entry), mv into a folder (files sorted by extension), grep -c (log lines of one level). Their templates never
# use a held-out kind's sentence.
class Backup(Kind):
    name = "backup"
    templates = ("Make a backup of {src} at {dst}.",
                 "Back up the file {src} to {dst}.",
                 "Save a spare copy of {src} as {dst}.",
                 "Duplicate {src} as {dst} so that there are two of it.")

    def make(self, rng):
        src = f"{rng.choice(_DIRS)}/{_file(rng)}"
        dst = rng.choice([f"{src}.bak", f"backup/{src.split('/')[-1]}", f"{src.rsplit('.', 1)[0]}.old"])
        text = _text(_lines(rng))
        files = {src: text}
        if dst.startswith("backup/"):
            files["backup/README.md"] = "backups\n"  # the folder exists
        _distractors(rng, files, src.split("/")[0])
        files[src] = text
        return self.instance(files, [{"file": _abs(dst), "text": text}, {"file": _abs(src), "text": text}],
                             src=_abs(src), dst=_abs(dst))

    def solve(self, fields, step, last_output):
        return f"cp {fields['src']} {fields['dst']}" if step == 0 else None


class AddEntry(Kind):
    name = "add_entry"
    templates = ("Append the entry {text} to the log {path}.",
                 "Log {text} in {path}: it goes after the last entry.",
                 "Record {text} in the log file {path} without changing the entries already there.",
                 "The log {path} needs one more entry at its end: {text}.")

    def make(self, rng):
        rel = f"logs/{rng.choice(_NAMES)}.log"
        text = f"{rng.choice(['done', 'start', 'stop', 'ok', 'sent'])}-{rng.choice(_WORDS)}{rng.randint(1, 99)}"
        before = _text(_lines(rng))
        return self.instance({rel: before}, [{"file": _abs(rel), "text": before + text + "\n"}],
                             text=text, path=_abs(rel))

    def solve(self, fields, step, last_output):
        return f"echo {fields['text']} >> {fields['path']}" if step == 0 else None


class SortByExt(Kind):
    name = "sort_by_ext"
    templates = ("Move every .{ext} file in {src} into the folder {folder}.",
                 "Put all the .{ext} files from {src} into the folder {folder}.",
                 "Sort the .{ext} files of {src} into {folder}.",
                 "The .{ext} files in {src} belong in the folder {folder}: move them there.")

    def make(self, rng):
        src, folder = rng.sample(_DIRS, 2)
        ext = rng.choice(_EXTS)
        files: dict[str, str] = {f"{folder}/{rng.choice(_NAMES)}.{rng.choice(_EXTS)}": _text(_lines(rng))}
        moved = {}
        for _ in range(rng.randint(1, 3)):
            moved.setdefault(_file(rng, ext), _text(_lines(rng)))
        moved = {n: t for n, t in moved.items() if f"{folder}/{n}" not in files}
        if not moved:  # the folder already held a file of that name: take another name
            moved = {f"new{rng.randint(1, 9)}.{ext}": _text(_lines(rng))}
        stay = {f"{src}/{_file(rng, rng.choice([e for e in _EXTS if e != ext]))}": _text(_lines(rng))}
        files.update({f"{src}/{n}": t for n, t in moved.items()})
        files.update(stay)
        checks = [c for n, t in sorted(moved.items())
                  for c in ({"file": _abs(f"{folder}/{n}"), "text": t}, {"absent": _abs(f"{src}/{n}")})]
        checks += [{"file": _abs(p), "text": t} for p, t in stay.items()]
        return self.instance(files, checks, ext=ext, src=_abs(src), folder=_abs(folder))

    def solve(self, fields, step, last_output):
        return f"mv {fields['src']}/*.{fields['ext']} {fields['folder']}/" if step == 0 else None


_LEVELS = ("ERROR", "WARN", "INFO", "DEBUG")


class CountLevel(Kind):
    name = "count_level"
    templates = ("Count the {level} lines in the log {path} and write the number to /app/answer.txt.",
                 "How many {level} entries does the log {path} have? Write the number to /app/answer.txt.",
                 "Write the number of {level} lines of {path} to /app/answer.txt.",
                 "Find how many lines of the log {path} are {level} lines and put that number in /app/answer.txt.",
                 "How many lines of the log {path} mention {level}? Write the number to /app/answer.txt.")

    def make(self, rng):
        rel = f"logs/{rng.choice(_NAMES)}.log"
        level = rng.choice(_LEVELS)
        lines = [f"{rng.choice(_LEVELS)} {_line(rng)}" for _ in range(rng.randint(4, 12))]
        lines[rng.randrange(len(lines))] = f"{level} {_line(rng)}"  # at least one
        count = sum(line.startswith(level + " ") for line in lines)
        return self.instance({rel: _text(lines)}, [{"answer": ANSWER, "accept": [str(count)]}],
                             level=level, path=_abs(rel))

    def solve(self, fields, step, last_output):
        return f"grep -c {fields['level']} {fields['path']} > {ANSWER}" if step == 0 else None


# held-out kinds: never in training data by default; each is a neighbour of a training kind
class MoveInto(Kind):
    name = "move_into"
    templates = ("Move the file {src} into the folder {folder}.",)

    def make(self, rng):
        src, folder = _file(rng, "txt"), rng.choice(_DIRS)
        files = {src: _text(_lines(rng)), f"{folder}/{rng.choice(_NAMES)}.log": _text(_lines(rng))}
        return self.instance(files, [{"file": _abs(f"{folder}/{src}"), "text": files[src]}, {"absent": _abs(src)}],
                             src=_abs(src), folder=_abs(folder))

    def solve(self, fields, step, last_output):
        return f"mv {fields['src']} {fields['folder']}/" if step == 0 else None


class CountMatches(Kind):
    name = "count_matches"
    templates = ("Count the lines in {path} that contain the word {word} and write the number to /app/answer.txt.",)

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
    templates = ("Copy the file {src} to {dst} and keep the original.",)

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
    templates = ("Add the line {text} at the end of {path}.",)

    def make(self, rng):
        rel = f"{rng.choice(_DIRS)}/{_file(rng)}"
        text = "-".join(rng.sample(_WORDS, 2)) + str(rng.randint(1, 99))
        before = _text(_lines(rng))
        return self.instance({rel: before}, [{"file": _abs(rel), "text": before + text + "\n"}],
                             text=text, path=_abs(rel))

    def solve(self, fields, step, last_output):
        return f"echo {fields['text']} >> {fields['path']}" if step == 0 else None


KINDS: dict[str, Kind] = {k.name: k for k in (CountLines(), CountFiles(), FindWord(), Rename(), Replace(), Create(),
                                              DeleteExt(), LineN(), FixTypo(), Backup(), AddEntry(), SortByExt(),
                                              CountLevel(), MoveInto(), CountMatches(), CopyFile(), AppendLine())}
HELDOUT_KINDS = ("move_into", "count_matches", "copy_file", "append_line")
TRAIN_KINDS = tuple(k for k in KINDS if k not in HELDOUT_KINDS)


def make_instance(kind: str, seed: int) -> Instance:
    """The instance of `kind` for `seed` (the same pair always gives the same instance)."""
    if kind not in KINDS:
        from slime_env.errors import InvalidInput

        raise InvalidInput(f"unknown terminal task kind {kind!r}; the kinds are {sorted(KINDS)}")
    rng = random.Random(f"{kind}:{seed}")
    inst = KINDS[kind].make(rng)
    # the paraphrase is drawn after the instance, so the files and checks of a (kind, seed) do not depend on it
    return dataclasses.replace(inst, instruction=rng.choice(KINDS[kind].templates).format(**inst.fields))


def find_instruction(text: str) -> tuple[Kind, dict[str, str], int] | None:
    """The kind, fields and start offset of the last instruction in `text` (a conversation), or None."""
    best = None
    for kind in KINDS.values():
        for pattern in kind.patterns:
            for m in pattern.finditer(text):
                if best is None or m.start() > best[2]:
                    best = (kind, m.groupdict(), m.start())
    return best


def parse_instruction(text: str) -> tuple[Kind, dict[str, str]] | None:
    """The kind and fields of the last instruction in `text` (a conversation), or None if it holds none."""
    found = find_instruction(text)
    return None if found is None else (found[0], found[1])
