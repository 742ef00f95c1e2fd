"""Terminal tasks: a procedurally generated family of Harbor task folders (count, find, rename, replace, create,
delete, extract a line, fix a one-letter typo, back up, append to a log, sort by extension, count log levels; several
paraphrased instructions per train kind; four held-out kinds) for agentic RL in containers, with a verifier
per task that reads only the final files, a scripted teacher per kind for SFT warm-ups, and `Terminal-v0`
(`TerminalEnv`: `bash` + `submit` in bubblewrap workspaces).

Entry points: `terminal_tasks` (a dataset for `train_data` / `eval_data`), `write_task` (one folder),
`python -m slime_env.envs.terminal --out DIR --n N` (many), `teacher_reply` (SFT data), `TerminalEnv`.
Imports the core, `slime_env.envs.harbor`, `slime_env.envs.workspace` and `tools_sandbox`; nothing imports it but
the registry's entry point and configs.
"""

from slime_env.loading import lazy_exports

_EXPORTS = {
    "TerminalEnv": "slime_env.envs.terminal.env", "terminal_tasks": "slime_env.envs.terminal.tasks",
    "write_task": "slime_env.envs.terminal.tasks", "teacher_reply": "slime_env.envs.terminal.teacher",
    "KINDS": "slime_env.envs.terminal.kinds", "TRAIN_KINDS": "slime_env.envs.terminal.kinds",
    "HELDOUT_KINDS": "slime_env.envs.terminal.kinds", "make_instance": "slime_env.envs.terminal.kinds",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
