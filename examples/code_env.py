"""Code-v0 end to end with a scripted policy: a wrong program, test feedback, the fix; then HumanEval grading,
and a solution that forges the grader's reports (it earns nothing: no verdict comes from its sandbox).

    python examples/code_env.py
"""

import asyncio
import json

from slime_env.envs.code import Grader, load_humaneval, parse_tests

import slime_env
from slime_env import ScriptedPolicy, get_renderer, run_episode
from slime_env.offline_tokenizers import smollm2

TASK = {"prompt": "Read two integers from one line and print their sum.",
        "label": {"input_output": json.dumps({"inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7\n"]})}}


async def main() -> None:
    tok = smollm2()
    wrong = "```python\na, b = map(int, input().split())\nprint(a * b)\n```"
    fixed = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    env = slime_env.make("Code-v0", max_attempts=2)
    traj = await run_episode(env, ScriptedPolicy(tok, [wrong, fixed]), TASK, renderer=get_renderer(tok), max_turns=3)
    feedback = [m.content for m in traj.messages if m.role == "user"][-1]
    print(f"Code-v0: status={traj.status} reward={traj.reward} turn_rewards={traj.turn_rewards}")
    print("feedback the model saw (masked in the trajectory):\n  " + feedback.replace("\n", "\n  "))

    grader = Grader()  # slime_env.tools_sandbox.auto()
    tasks = load_humaneval(limit=10)
    results = await asyncio.gather(*(grader.grade(t.metadata["prompt_code"] + t.metadata["canonical_solution"],
                                                  parse_tests(t.label)) for t in tasks))
    print(f"HumanEval canonical solutions: {sum(r.all_passed for r in results)}/{len(tasks)} pass "
          f"({sum(r.total for r in results)} test cases)")

    # Return nothing, then write "pass"-shaped lines to every file descriptor and exit: once a known hack.
    forged_lines = "\n".join(json.dumps(line) for line in
                              [["loaded"], *[[i, "pass", None] for i in range(20)],
                               *[["call", k, {"status": "ok", "value": True}] for k in range(20)]])
    forger = (tasks[0].metadata["prompt_code"] + "    return None\n\nimport os\nfor fd in range(3, 64):\n"
              f"    try:\n        os.write(fd, {forged_lines + chr(10)!r}.encode())\n    except OSError:\n"
              "        pass\nos._exit(0)\n")
    forged = await grader.grade(forger, parse_tests(tasks[0].label))
    # The lines can only claim that calls returned True: exactly what returning True earns.
    honest = await grader.grade(tasks[0].metadata["prompt_code"] + "    return True\n", parse_tests(tasks[0].label))
    print(f"{tasks[0].id}: forged reports pass {forged.passed}/{forged.total} cases; "
          f"`return True` passes {honest.passed}/{honest.total}")
    await grader.sandbox.close()


if __name__ == "__main__":
    asyncio.run(main())
