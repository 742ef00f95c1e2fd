"""Terminal tasks (`slime_env.envs.terminal`, `Terminal-v0`): the generator is deterministic and its splits are
disjoint; every kind's scripted solution passes its own verifier and wrong ones fail, in real bubblewrap workspaces
(the verifier in a fresh one). A one-step `slime-env train` of examples/terminal_train.yaml is not here: shrunk to
one step it took 262 s and 5.3 GB on the 2-core machine (budget: 40 s, 4 GB); docs/terminal.md has the full run."""

from __future__ import annotations

import asyncio
import filecmp
from pathlib import Path

import pytest

import slime_env
from slime_env import InvalidInput, ScriptedPolicy, get_renderer, run_episode
from slime_env.envs.terminal.kinds import HELDOUT_KINDS, KINDS, TRAIN_KINDS, make_instance, parse_instruction
from slime_env.envs.terminal.tasks import instances, split_of, terminal_tasks, write_task
from slime_env.envs.terminal.teacher import call, teacher_reply


def _same_tree(a: Path, b: Path) -> bool:
    cmp = filecmp.dircmp(a, b)
    if cmp.left_only or cmp.right_only or cmp.diff_files or cmp.funny_files:
        return False
    _, mismatch, errors = filecmp.cmpfiles(a, b, cmp.common_files, shallow=False)
    return not mismatch and not errors and all(_same_tree(a / d, b / d) for d in cmp.common_dirs)


def test_the_generator_is_deterministic_and_its_splits_and_kinds_are_disjoint(tmp_path):
    for kind in KINDS:
        assert _same_tree(write_task(tmp_path / "a", kind, 7), write_task(tmp_path / "b", kind, 7)), kind
        assert make_instance(kind, 7) == make_instance(kind, 7) and make_instance(kind, 7) != make_instance(kind, 8)
    train, test = instances(400, seed=1, split="train"), instances(100, seed=2, split="test")
    assert train == instances(400, seed=1, split="train") and not set(train) & set(test)
    assert all(split_of(k, s) == "train" for k, s in train) and all(split_of(k, s) == "test" for k, s in test)
    assert {k for k, _ in train} == set(TRAIN_KINDS) and not set(HELDOUT_KINDS) & set(TRAIN_KINDS)
    assert {k for k, _ in instances(8, seed=3, kinds="heldout")} == set(HELDOUT_KINDS)
    assert len({s for _, s in instances(2000, seed=4)}) > 1990  # thousands of distinct instances
    rows = terminal_tasks(3, seed=5, split="test", root=str(tmp_path / "cache"))
    assert rows == terminal_tasks(3, seed=5, split="test", root=str(tmp_path / "cache"))
    for row in rows:
        folder = Path(row["metadata"]["harbor_task"])
        assert row["prompt"] == (folder / "instruction.md").read_text().strip()
        assert 'split = "test"' in (folder / "task.toml").read_text()


def test_every_kind_writes_a_folder_harbor_reads(tmp_path):
    """Harbor's own task model (harbor 0.26) and our reader accept every kind's folder."""
    import tomllib

    from harbor.models.task.config import TaskConfig

    from slime_env.envs.harbor import load_task

    for kind in KINDS:
        folder = write_task(tmp_path, kind, 3)
        TaskConfig.model_validate(tomllib.loads((folder / "task.toml").read_text()))
        task = load_task(folder)
        assert task.config.environment.workdir == "/app"
        assert task.instruction.strip() == make_instance(kind, 3).instruction


def test_the_teacher_reads_every_kind_back_from_its_instruction():
    for kind in KINDS:
        for seed in range(5):
            inst = make_instance(kind, seed)
            context = f"<|im_start|>user\n{inst.instruction}<|im_end|>\n<|im_start|>assistant\n"
            assert parse_instruction(context) == (KINDS[kind], inst.fields), (kind, seed)
            assert teacher_reply(context) == call("bash", command=inst.solution[0])


def test_every_template_reads_back_and_no_held_out_sentence_is_trained_on():
    """Every paraphrase of every kind parses back to its own kind and fields (the teacher's only input), and no
    train kind's template is a held-out kind's: the held-out kinds' sentences reach neither SFT nor GRPO."""
    for kind, k in KINDS.items():
        names = {tuple(sorted(p.groupindex)) for p in k.patterns}
        assert len(names) == 1, kind  # every template names the same fields
        fields = make_instance(kind, 1).fields
        for template in k.templates:
            text = f"<|im_start|>user\n{template.format(**fields)}<|im_end|>\n"
            assert parse_instruction(text) == (k, fields), (kind, template)
    train = {t for k in TRAIN_KINDS for t in KINDS[k].templates}
    assert all(len(KINDS[k].templates) >= 3 for k in TRAIN_KINDS)
    assert not train & {t for k in HELDOUT_KINDS for t in KINDS[k].templates}
    # instances draw their paraphrase: a train kind's instances show more than one sentence
    assert all(len({make_instance(k, s).instruction.split(" /app")[0] for s in range(40)}) > 1 for k in TRAIN_KINDS)


def test_bad_input_names_the_field(tmp_path):
    with pytest.raises(InvalidInput, match=r"unknown kinds \['nope'\]"):
        terminal_tasks(2, kinds=["count_lines", "nope"], root=str(tmp_path))
    with pytest.raises(InvalidInput, match=r"split must be 'train', 'test' or None, got 'dev'"):
        terminal_tasks(2, split="dev", root=str(tmp_path))
    with pytest.raises(InvalidInput, match=r"unknown terminal task kind 'x'"):
        make_instance("x", 1)


WRONG = {  # a plausible wrong solution per kind: the verifier must say 0
    "count_lines": "wc -l {path} > /app/answer.txt",         # "N path", not N
    "count_files": "ls -a {folder} | wc -l > /app/answer.txt",  # counts . and ..
    "find_word": "echo {folder} > /app/answer.txt",
    "rename": "cp {src} {dst}",                               # the original stays
    "replace": "sed -i 's/{old}/{new}/' {path}; echo {new} >> {path}",
    "create": "echo {text}. > {path}",
    "delete_ext": "rm {folder}/*",
    "line_n": "head -n {n} {path} > /app/answer.txt",
    "fix_typo": "sed -i '1d' {path}",
    "backup": "mv {src} {dst}",                               # the original is gone
    "add_entry": "echo {text} > {path}",                      # the earlier entries are gone
    "sort_by_ext": "cp {src}/*.{ext} {folder}/",              # the originals stay
    "count_level": "grep {level} {path} | head -1 > /app/answer.txt",
    "move_into": "cp {src} {folder}/",
    "count_matches": "grep {word} {path} > /app/answer.txt",
    "copy_file": "mv {src} {dst}",
    "append_line": "echo {text} > {path}",
}
FORGE = ("mkdir -p /logs/verifier /tests; echo 1 > /logs/verifier/reward.txt; echo PASS; "
         "printf 'exit 0' > /tests/test.sh")


def test_every_kind_is_solved_by_its_script_and_wrong_or_forged_work_scores_0(smollm2_tok, tmp_path):
    """Real bubblewrap workspaces: the teacher (the scripted solution) earns 1 on every kind, a plausible wrong
    solution 0, and an agent that writes reward.txt, prints PASS and rewrites /tests in its own workspace 0."""
    from workspace_support import require_backend

    require_backend("bwrap")
    tasks = terminal_tasks(len(KINDS), seed=11, kinds="all", root=str(tmp_path))
    renderer = get_renderer(smollm2_tok)

    def scripted(*commands):
        return ScriptedPolicy(smollm2_tok, [*(call("bash", command=c) for c in commands), call("submit")])

    async def play(task, policy):
        env = slime_env.make("Terminal-v0")
        try:
            return await run_episode(env, policy, task, renderer=renderer, max_turns=4)
        finally:
            await env.close()

    async def main():
        gate = asyncio.Semaphore(4)

        async def one(task, policy):
            async with gate:
                return await play(task, policy)

        runs = []
        for task in tasks:
            fields = make_instance(task["metadata"]["kind"], task["metadata"]["seed"]).fields
            runs += [one(task, ScriptedPolicy(smollm2_tok, teacher_reply)),
                     one(task, scripted(WRONG[task["metadata"]["kind"]].format(**fields))),
                     one(task, scripted(FORGE))]
        return await asyncio.gather(*runs)

    results = asyncio.run(main())
    for i, task in enumerate(tasks):
        solved, wrong, forged = results[3 * i: 3 * i + 3]
        kind = task["metadata"]["kind"]
        assert solved.status == "completed" and solved.reward == 1.0, (kind, solved.status, solved.reason)
        assert wrong.status == "completed" and wrong.reward == 0.0, kind
        assert forged.status == "completed" and forged.reward == 0.0, kind
    assert {t["metadata"]["kind"] for t in tasks} == set(KINDS)


def test_a_workspace_that_does_not_start_is_infra_error_never_a_0(smollm2_tok, tmp_path):
    from workspace_support import require_backend

    require_backend("bwrap")
    task = terminal_tasks(1, seed=3, split="test", root=str(tmp_path))[0]
    env = slime_env.make("Terminal-v0", image=str(tmp_path / "no-such-root"))

    async def main():
        try:
            return await run_episode(env, ScriptedPolicy(smollm2_tok, teacher_reply), task,
                                     renderer=get_renderer(smollm2_tok), max_turns=4)
        finally:
            await env.close()

    traj = asyncio.run(main())
    assert traj.status == "infra_error" and "did not start" in traj.reason and "no-such-root" in traj.reason
