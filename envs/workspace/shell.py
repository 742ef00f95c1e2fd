"""A bash whose state persists between tool calls: each command runs in a fresh `bash`, which first restores what
the previous one left (working directory, variables, exported or not, functions, aliases, shell options) and saves
it again on exit — even when the command calls `exit` or times out before the trap (then the state before it stays).
A hung or killed command therefore never breaks the session, and concurrent calls cannot corrupt one live shell.
"""

from __future__ import annotations

STATE = "/tmp/.slime_env_shell"

# Variables bash sets itself (read-only or per process): never saved or restored.
_SKIP = ("BASH[A-Z_]*|EUID|PPID|SHELLOPTS|UID|FUNCNAME|GROUPS|DIRSTACK|PIPESTATUS|_|COLUMNS|LINES|HISTCMD|"
         "LINENO|RANDOM|SECONDS|SRANDOM|EPOCHSECONDS|EPOCHREALTIME|OPTIND|OPTERR|PWD|OLDPWD|SHLVL|HOSTNAME|"
         "HOSTTYPE|MACHTYPE|OSTYPE|SLIME_ENV_COMMAND|__slime_[a-z_]*")

WRAPPER = r"""
__slime_state="%(state)s.$(id -u)"
__slime_save() {
  local __slime_rc=$?
  {
    declare -p 2>/dev/null | grep -Ev '^declare -[-a-zA-Z]*r[a-zA-Z]* |^declare -[-a-zA-Z]* (%(skip)s)='
    declare -f
    alias -p
    shopt -p 2>/dev/null
    printf 'cd -- %%q 2>/dev/null\n' "$PWD"
  } > "$__slime_state.tmp" 2>/dev/null && mv -f "$__slime_state.tmp" "$__slime_state"
  return $__slime_rc
}
if [ -f "$__slime_state" ]; then . "$__slime_state" 2>/dev/null; fi
trap '__slime_save' EXIT
eval "$SLIME_ENV_COMMAND"
""" % {"state": STATE, "skip": _SKIP}


def argv(command: str) -> tuple[list[str], dict[str, str]]:
    """(argv, env) that run `command` in the persistent bash."""
    return ["bash", "-c", WRAPPER], {"SLIME_ENV_COMMAND": command}


def format_result(result, timeout_s: float) -> str:
    """What the model reads for one command: its output (stderr after stdout), then how it ended if not 0."""
    out = result.stdout
    if result.stderr:
        out = f"{out}{'' if not out or out.endswith(chr(10)) else chr(10)}{result.stderr}"
    notes = []
    if result.status == "timeout":
        notes.append(f"[the command timed out after {timeout_s:g}s and was killed]")
    elif result.status == "output_limit":
        notes.append("[the output was too long and was cut; the command was killed]")
    elif result.status == "memory":
        notes.append(f"[killed: {result.reason}]")
    elif result.status == "sandbox_error":
        notes.append(f"[the command could not run: {result.reason}]")
    elif result.exit_code:
        notes.append(f"[exit code {result.exit_code}]")
    text = out.rstrip("\n")
    if notes:
        text = f"{text}\n{' '.join(notes)}" if text else " ".join(notes)
    return text or "(no output)"
