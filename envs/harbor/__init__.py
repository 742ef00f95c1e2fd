"""Harbor task folders (PyPI `harbor` 0.26's format) in slime_env: read them (`load_task`, `load_dataset`), build
their images, run their oracle and verifier over a workspace (`run_oracle`, `verify`), and export trajectories
as ATIF (`to_atif`). `slime-env harbor check | validate` checks a folder of tasks.

Imports `slime_env` core and `slime_env.tools_sandbox` only; never the `harbor` package (it needs Python >= 3.12).
"""

from slime_env.envs.harbor.config import TaskConfig
from slime_env.envs.harbor.task import HarborTask, load_dataset, load_task, strip_canary

__all__ = ["HarborTask", "TaskConfig", "load_dataset", "load_task", "strip_canary"]
