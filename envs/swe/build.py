"""The generator: repositories in, validated Harbor task folders and a build log out.

For each repository of the manifest (`build_dataset`):
1. build its image (`manifest.repo_dockerfile`; cached by Docker after the first time);
2. run its suite twice on the clean code in workspaces (`--junitxml`): tests that pass both times are the
   baseline, tests whose outcome differs (flaky) or that fail are deselected from then on;
3. list the candidate mutations of its source files (`mutations.find_mutations`) and order them (`plan`);
4. validate candidates in that order, `parallel` at a time, one workspace each: write the mutant, run the suite,
   put the file back. A candidate is kept iff at least one baseline test fails (FAIL_TO_PASS), no more than
   `max_fail_to_pass` do, the run did not time out, the FAIL_TO_PASS tests fail again when run alone (not flaky),
   and the guard accepts the oracle (the clean file) as a fix. PASS_TO_PASS = the rest of the baseline;
5. keep the first `per_repo` kept candidates (in plan order, so parallelism changes nothing) and write each as a
   task folder (`task.write_task`) with its statement (`statement.write_statement`).

Every candidate and repository is a JSON line of the build log, with its verdict, reason and timings.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from slime_env.envs.swe import grade
from slime_env.envs.swe.guard import review
from slime_env.envs.swe.manifest import WORKDIR, RepoSpec, ensure_image, repo_dockerfile, repo_image_tag
from slime_env.envs.swe.mutations import KINDS, Mutation, find_mutations, plan
from slime_env.envs.swe.patches import make_patch
from slime_env.envs.swe.reward import read_watched
from slime_env.envs.swe.statement import write_statement
from slime_env.envs.swe.task import SweTask, write_task


@dataclass
class BuildConfig:
    """How many tasks per repository (`per_repo`), the plan's `seed`, validations at once (`parallel`), the most
    FAIL_TO_PASS tests a kept bug may have, candidates per function, and the share of one kind among kept tasks."""

    per_repo: int = 30
    seed: int = 0
    parallel: int = 2
    max_fail_to_pass: int = 30
    per_function: int = 2
    max_kind_share: float = 0.25
    max_candidates: int | None = None
    cpus: float = 1.0
    memory_mb: int = 2048


@dataclass
class SuiteRun:
    outcomes: dict[str, tuple[str, str]]
    exit_code: int | None
    status: str
    seconds: float
    texts: dict[str, str] = field(default_factory=dict)


@dataclass
class RepoBuild:
    """What building one repository produced: its kept tasks and its log records."""

    spec: RepoSpec
    image: str
    tasks: list[tuple[SweTask, dict[str, str]]] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)


async def run_suite(ws, targets, deselect, *, timeout_s: float, files=(), user: str | None = None,
                    tb: str = "short") -> SuiteRun:
    """Run pytest on `targets` in a workspace and read its JUnit report host-side (`files`: the suite's test files,
    for node ids; `tb="locals"` also keeps each failure's traceback with locals, in `texts`)."""
    junit = f"/tmp/junit-{time.monotonic_ns()}.xml"
    t = time.monotonic()
    res = await ws.exec(grade.pytest_argv(targets, deselect, junit, tb=tb), cwd=WORKDIR, env=grade.PYTEST_ENV,
                        user=user, timeout_s=timeout_s)
    seconds = time.monotonic() - t
    if res.status in ("timeout", "memory"):
        return SuiteRun({}, None, res.status, seconds)
    try:
        data = await ws.read_file(junit)
        outcomes = grade.parse_junit(data, files)
        texts = grade.failure_texts(data, files) if tb == "locals" else {}
        await ws.exec(["rm", "-f", junit])
    except (FileNotFoundError, grade.ET.ParseError) as e:
        tail = " ".join((res.stderr or res.stdout).split())[-200:]
        return SuiteRun({}, res.exit_code, f"no report ({type(e).__name__}; pytest exited {res.exit_code}: {tail})",
                        seconds)
    return SuiteRun(outcomes, res.exit_code, "ok", seconds, texts)


async def _clean_run(ws, targets, deselect, files) -> SuiteRun:
    """The suite on the clean code; a run without a report is tried again (twice) before the build gives up."""
    for _ in range(3):
        run = await run_suite(ws, targets, deselect, timeout_s=900, files=files)
        if run.status == "ok":
            return run
    raise RuntimeError(f"the clean suite did not run: {run.status}")


def _public_names(sources: dict[str, str], spec: RepoSpec) -> set[str]:
    """The package's public module-level functions and classes (what a statement may name a test's subject)."""
    import ast

    names: set[str] = set()
    for path, text in sources.items():
        if spec.is_source_path(path):
            for node in ast.parse(text).body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name[0] != "_":
                    names.add(node.name)
    return names


def _difficulty(n_fail_to_pass: int) -> str:
    """More failing tests, more clues: 1 test is hard, 2-4 medium, 5 or more easy."""
    return "hard" if n_fail_to_pass == 1 else "medium" if n_fail_to_pass < 5 else "easy"


async def build_repo(spec: RepoSpec, config: BuildConfig, *, log: Callable[[str], None] = print,
                     start_workspace=None) -> RepoBuild:
    """Validate candidates of one repository until `config.per_repo` are kept (see the module docstring)."""
    from slime_env.tools_sandbox.workspace import Limits, WorkspaceSpec

    start_workspace = start_workspace or _open
    dockerfile = repo_dockerfile(spec)
    image = repo_image_tag(dockerfile)
    out = RepoBuild(spec, image)
    t0 = time.monotonic()
    await ensure_image(dockerfile, image)
    image_s = time.monotonic() - t0
    ws_spec = WorkspaceSpec(image=image, workdir=WORKDIR, limits=Limits(
        cpus=config.cpus, memory_mb=config.memory_mb, pids=512, network="none", wall_time_s=6 * 3600))
    workers = await asyncio.gather(*(start_workspace(ws_spec) for _ in range(max(1, config.parallel))))
    try:
        targets = list(spec.test_paths)
        deselect = list(spec.deselect)
        tree, _ = await read_watched(workers[0], spec)  # what the guard watches: sources, tests, configuration
        files = sorted(p for p in tree if p.endswith(".py") and spec.is_test_path(p))
        clean = list(await asyncio.gather(*(_clean_run(workers[i % len(workers)], targets, deselect, files)
                                            for i in range(2))))
        (a, b) = (clean[0].outcomes, clean[1].outcomes)
        flaky = sorted(t for t in set(a) | set(b) if a.get(t, ("missing",))[0] != b.get(t, ("missing",))[0])
        failing = sorted(t for t in a if t not in flaky and a[t][0] in (grade.FAILED, grade.ERROR))
        baseline = sorted(t for t in a if t not in flaky and a[t][0] == grade.PASSED)
        deselect += [t for t in flaky + failing if "::" in t]
        clean_s = max(r.seconds for r in clean)
        timeout_s = max(60.0, 4 * clean_s + 30)
        sources = {p: v.decode("utf-8") for p, v in tree.items() if isinstance(v, bytes) and p.endswith(".py")}
        names = _public_names(sources, spec)
        candidates = []
        for path in sorted(p for p in sources if spec.is_source_path(p)):
            candidates += find_mutations(path, sources[path])
        ordered = plan(candidates, seed=f"{config.seed}:{spec.name}", per_function=config.per_function)
        if config.max_candidates:
            ordered = ordered[:config.max_candidates]
        out.records.append({"event": "repo", "repo": spec.name, "version": spec.version, "image": image,
                            "image_s": round(image_s, 1), "clean_runs_s": [round(r.seconds, 2) for r in clean],
                            "tests": len(a), "baseline": len(baseline), "flaky": flaky, "failing_on_clean": failing,
                            "candidates": len(candidates), "planned": len(ordered),
                            "candidates_by_kind": dict(Counter(m.kind for m in candidates))})
        log(f"{spec.name} {spec.version}: image {image_s:.0f}s, {len(baseline)} baseline tests "
            f"({len(flaky)} flaky, {len(failing)} failing on clean), clean run {clean_s:.1f}s, "
            f"{len(candidates)} candidates, {len(ordered)} planned")
        async def respawn(dead):
            """A worker whose workspace died (a mutant hung it past the agent's deadline) gets a fresh one."""
            await asyncio.gather(dead.close(), return_exceptions=True)
            fresh = await start_workspace(ws_spec)
            workers[workers.index(dead)] = fresh
            return fresh

        verdicts = await _validate_all(spec, config, workers, ordered, sources, baseline, targets, deselect,
                                       timeout_s, log, files, respawn)
    finally:
        await asyncio.gather(*(w.close() for w in workers), return_exceptions=True)
    kind_cap = max(2, math.ceil(config.per_repo * config.max_kind_share))
    kept_by_kind: Counter[str] = Counter()
    for i, m in enumerate(ordered):
        v = verdicts.get(i)
        if v is None:
            continue
        rec = {"event": "candidate", "repo": spec.name, "index": i, "key": m.key, "kind": m.kind, "file": m.file,
               "line": m.line, "function": m.function, "description": m.description, **v["record"]}
        if rec["status"] == "kept":
            if len(out.tasks) >= config.per_repo:
                rec.update(status="rejected", reason="enough tasks already")
            elif kept_by_kind[m.kind] >= kind_cap:
                rec.update(status="rejected", reason=f"kind quota ({kind_cap} {m.kind} tasks kept already)")
            else:
                kept_by_kind[m.kind] += 1
                task = _make_task(spec, image, m, sources, v, baseline, deselect, names, config, tree)
                out.tasks.append(task)
                rec["task"] = task[0].name
        out.records.append(rec)
    return out


async def _validate_all(spec, config, workers, ordered, sources, baseline, targets, deselect, timeout_s, log, files,
                        respawn):
    """Validate `ordered` candidates on the workers, stopping once enough are kept among the first ones. A
    candidate whose run kills its workspace is rejected as a timeout, and the worker goes on in a fresh one."""
    from slime_env.tools_sandbox.workspace import WorkspaceError

    verdicts: dict[int, dict] = {}
    kind_cap = max(2, math.ceil(config.per_repo * config.max_kind_share))
    state = {"next": 0}

    def settled() -> tuple[int, Counter]:
        """Kept tasks and kept kinds among the longest finished prefix of the plan."""
        kept, kinds = 0, Counter()
        for i in range(len(ordered)):
            v = verdicts.get(i)
            if v is None:
                break
            if v["record"]["status"] == "kept" and kinds[ordered[i].kind] < kind_cap:
                kept += 1
                kinds[ordered[i].kind] += 1
        return kept, kinds

    async def worker(ws) -> None:
        ws = workers[ws]
        while True:
            kept, kinds = settled()
            if kept >= config.per_repo or state["next"] >= len(ordered):
                return
            i = state["next"]
            state["next"] += 1
            if kinds[ordered[i].kind] >= kind_cap:
                verdicts[i] = {"record": {"status": "rejected", "reason": "kind quota", "seconds": 0.0}}
                continue
            t = time.monotonic()
            try:
                verdicts[i] = await _validate(ws, spec, ordered[i], sources, baseline, targets, deselect, timeout_s,
                                              config, files)
            except WorkspaceError as e:
                verdicts[i] = {"record": {"status": "rejected", "reason": "the suite timed out",
                                          "detail": f"its workspace stopped answering: {e}",
                                          "seconds": round(time.monotonic() - t, 2)}}
                ws = await respawn(ws)
            r = verdicts[i]["record"]
            log(f"  [{i}] {ordered[i].kind} {ordered[i].file}:{ordered[i].line} {ordered[i].function}: "
                f"{r['status']}{'' if r['status'] == 'kept' else ' (' + r['reason'] + ')'} "
                f"{r.get('fail_to_pass', '')} {r['seconds']:.1f}s")

    await asyncio.gather(*(worker(i) for i in range(len(workers))))
    return verdicts


async def _validate(ws, spec, m: Mutation, sources, baseline, targets, deselect, timeout_s, config, files) -> dict:
    t = time.monotonic()
    original = sources[m.file]
    mutant = m.apply(original)
    path = f"{WORKDIR}/{m.file}"

    def done(status: str, reason: str, **extra) -> dict:
        record = {"status": status, "reason": reason, "seconds": round(time.monotonic() - t, 2)}
        record.update({k: v for k, v in extra.items() if k in ("fail_to_pass", "run_s")})
        return {"record": record, **extra}

    problems = review(spec, {m.file: mutant.encode()}, {m.file: original.encode()}, {m.file: original.encode()})
    if not problems.accepted:
        return done("rejected", f"the guard would refuse the oracle: {problems.reason}")
    await ws.write_file(path, mutant)
    try:
        run = await run_suite(ws, targets, deselect, timeout_s=timeout_s, files=files)
        if run.status != "ok":
            why = {"timeout": "the suite timed out", "memory": f"the suite ran out of memory ({config.memory_mb} MB)"}
            return done("rejected", why.get(run.status, run.status))
        f2p = [t for t in baseline if run.outcomes.get(t, (grade.MISSING, ""))[0] != grade.PASSED]
        if not f2p:
            return done("rejected", "no test fails", run_s=round(run.seconds, 2))
        if len(f2p) > config.max_fail_to_pass:
            return done("rejected", f"breaks too much ({len(f2p)} tests fail)", fail_to_pass=len(f2p))
        again = await run_suite(ws, f2p, (), timeout_s=timeout_s, files=files, tb="locals")
        passing = [t for t in f2p if again.outcomes.get(t, (grade.MISSING, ""))[0] == grade.PASSED]
        if again.status != "ok" or passing or not again.outcomes:
            return done("rejected", f"flaky: {len(passing)} of {len(f2p)} FAIL_TO_PASS tests pass when run alone"
                        if again.status == "ok" else f"the FAIL_TO_PASS tests alone: {again.status}",
                        fail_to_pass=len(f2p))
    finally:
        await ws.write_file(path, original)
    failures = []
    for node in f2p:
        outcome, message = run.outcomes.get(node, (grade.MISSING, "the test did not run"))
        failures.append((node, with_locals(message or outcome, again.texts.get(node, ""), spec)))
    return done("kept", "", fail_to_pass=len(f2p), run_s=round(run.seconds, 2), f2p=f2p, failures=failures,
                mutant=mutant)


_FRAME_AT = re.compile(r"^(\S+\.py):\d+: ")
_LOCAL = re.compile(r"^\w+\s*= ")
_FRAME_SPLIT = re.compile(r"^(?:_ )+_?\s*$", re.M)


def with_locals(message: str, text: str, spec: RepoSpec) -> str:
    """A bare failure message (`AssertionError`, nothing more) with the local variables of the innermost test
    frame of its traceback (`expected = [...]`, `result = [...]`): what the test compared. Frames of the
    package's own code are never shown (their lines would point at the bug)."""
    if not text or not re.fullmatch(r"[\w.]*", message.strip()):
        return message
    for frame in reversed(_FRAME_SPLIT.split(text)):
        lines = frame.strip("\n").splitlines()
        where = next((m.group(1) for line in reversed(lines) if (m := _FRAME_AT.match(line))), None)
        if where is None or not spec.is_test_path(where):
            continue
        local: dict[str, str] = {}
        for line in lines:
            if _LOCAL.match(line) and not line.startswith(("self ", "cls ")):
                name, _, value = line.partition("=")
                local.setdefault(name.strip(), value.strip())
        if local:
            return message + "\n" + "\n".join(f"{name} = {value}" for name, value in local.items())
    return message


def _hidden_files(spec: RepoSpec, f2p: list[str]) -> list[str]:
    hidden = grade.test_files(f2p)
    if len(hidden) != len({t.split("::", 1)[0] for t in f2p}):
        raise RuntimeError(f"{spec.name}: FAIL_TO_PASS ids that name no test file: {f2p}")
    return hidden


def visible_test_files(baseline: list[str], hidden: list[str]) -> list[str]:
    """The suite's test files (of the tests that pass on the clean code) left in the agent's checkout."""
    return [f for f in grade.test_files(baseline) if f not in set(hidden)]


def _make_task(spec, image, m: Mutation, sources, v, baseline, deselect, names, config, tree):
    f2p = v["f2p"]
    hidden = _hidden_files(spec, f2p)
    protected = {p: hashlib.sha256(data).hexdigest() for p, data in tree.items()
                 if isinstance(data, bytes) and not spec.is_source_path(p) and p not in hidden}
    name = f"{spec.name}__{m.kind}__{m.function.replace('.', '-').strip('_') or 'module'}__{m.key}"
    patch = make_patch(m.file, sources[m.file], v["mutant"])
    statement = write_statement(name=name, repo=spec.name, source_dir=spec.source_dir, failures=v["failures"],
                                names=names, source_files=[p for p in sources if spec.is_source_path(p)],
                                suite_visible=bool(visible_test_files(baseline, hidden)))
    task = SweTask(
        name=name, repo=spec.name, version=spec.version, sdist_sha256=spec.sdist_sha256, image=image,
        repo_dockerfile=repo_dockerfile(spec), source_dir=spec.source_dir, test_paths=tuple(spec.test_paths),
        deselect=tuple(deselect), fail_to_pass=tuple(f2p), pass_to_pass=tuple(t for t in baseline if t not in f2p),
        hidden_tests=tuple(hidden), bug_patch=patch,
        mutation={"kind": m.kind, "file": m.file, "line": m.line, "function": m.function,
                  "description": m.description},
        instruction=statement, protected=protected, difficulty=_difficulty(len(f2p)), cpus=config.cpus,
        memory_mb=config.memory_mb)
    return task, {h: sources[h] for h in hidden}


async def _open(spec):
    from slime_env.tools_sandbox.workspace import open_workspace

    return await open_workspace(spec)


async def build_dataset(out_dir: str | Path, repos: list[RepoSpec], config: BuildConfig, *,
                        log: Callable[[str], None] = print, start_workspace=None) -> dict:
    """Build every repository of `repos` into `out_dir`: task folders (those of these repositories replaced),
    `BUILD_LOG.jsonl` and `BUILD_SUMMARY.json`. Returns the summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    records: list[dict] = [{"event": "build", "seed": config.seed, "per_repo": config.per_repo,
                            "parallel": config.parallel, "max_fail_to_pass": config.max_fail_to_pass,
                            "repos": [f"{r.name}=={r.version}" for r in repos]}]
    summary: dict = {"seed": config.seed, "per_repo": config.per_repo, "repos": {}, "kinds": {}}
    for spec in repos:
        t = time.monotonic()
        built = await build_repo(spec, config, log=log, start_workspace=start_workspace)
        for old in out.glob(f"{spec.name}__*"):
            if (old / "task.toml").exists():
                shutil.rmtree(old)
        for task, hidden in built.tasks:
            write_task(out, task, hidden)
        records += built.records
        cands = [r for r in built.records if r["event"] == "candidate"]
        summary["repos"][spec.name] = {
            "version": spec.version, "tasks": len(built.tasks), "validated": len(cands),
            "kinds": dict(Counter(t.mutation["kind"] for t, _ in built.tasks)),
            "rejected": dict(Counter(r["reason"].split(":")[0].split(" (")[0] for r in cands
                                     if r["status"] != "kept")),
            "seconds": round(time.monotonic() - t, 1)}
        log(f"{spec.name}: {len(built.tasks)} tasks from {len(cands)} candidates in {time.monotonic() - t:.0f}s")
    summary["tasks"] = sum(r["tasks"] for r in summary["repos"].values())
    for k in KINDS:
        summary["kinds"][k] = sum(r["kinds"].get(k, 0) for r in summary["repos"].values())
    summary["wall_s"] = round(time.monotonic() - t0, 1)
    records.append({"event": "summary", **summary})
    with open(out / "BUILD_LOG.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r, sort_keys=False) + "\n")
    (out / "BUILD_SUMMARY.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary
