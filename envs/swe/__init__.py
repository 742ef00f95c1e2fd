"""SWE-style repository tasks built offline: bug-fix tasks generated from pinned PyPI sdists that ship their
test suites, emitted as Harbor task folders, and scored on a clean copy of the repository.

- `repos.toml` / `manifest`: the pinned repositories and the Dockerfile of each one's image;
- `mutations`: SWE-smith-style AST-guided bug injection (seven kinds of minimal one-site edits);
- `build`: validation in workspaces (FAIL_TO_PASS / PASS_TO_PASS from JUnit reports) and the dataset build
  (`slime-env swe build`, `make swe-tasks`), with its build log;
- `statement`: problem statements from the failing tests' names and messages;
- `task`: a task as a Harbor folder (`write_task`, `load_task`); `grade`: the pytest command and the grading,
  shared by the reward and the folders' own `tests/test.sh`;
- `reward.swe_reward`: the hidden tests on a clean copy with the agent's diff, in a fresh workspace, behind the
  `guard` (only edits of existing `.py` files under the package, written with the module's own names);
- `check`: a task end to end (nop earns 0, the oracle 1), `slime-env swe check`.

This package may import `slime_env` and `slime_env.tools_sandbox` (lazily: generating statements or reading task
folders needs no Docker); nothing in the core imports it. `swe_tasks(path)` gives the folders as `Harbor-v0` tasks
(Harbor-v0 scores them with `swe_reward`). See docs/agentic.md, "SWE-style repository tasks".
"""

from slime_env.envs.swe.reward import SweReward, swe_reward
from slime_env.envs.swe.task import SweTask, find_tasks, load_task, swe_tasks

__all__ = ["SweReward", "SweTask", "find_tasks", "load_task", "swe_reward", "swe_tasks"]
