"""Harbor task folders (PyPI `harbor` 0.26's format) in slime_env: read them (`load_task`, `load_dataset`), build
their images, run their oracle and verifier over a workspace (`run_oracle`, `verify`), and export trajectories
as ATIF (`to_atif`), and run them as RL episodes (`HarborEnv`, env id `Harbor-v0`; `harbor_tasks(path)` for a run's
data). `slime-env harbor check | validate | eval` checks a folder of tasks or evaluates a policy on it.

Imports `slime_env` core and `slime_env.tools_sandbox` only; never the `harbor` package (it needs Python >= 3.12).
"""

from slime_env.envs.harbor.config import TaskConfig
from slime_env.envs.harbor.env import HarborEnv, harbor_task, harbor_tasks, harbor_verify, harbor_workspace
from slime_env.envs.harbor.task import HarborTask, load_dataset, load_task, strip_canary

__all__ = ["HarborEnv", "HarborTask", "TaskConfig", "harbor_task", "harbor_tasks", "harbor_verify", "harbor_workspace",
           "load_dataset", "load_task", "strip_canary"]
