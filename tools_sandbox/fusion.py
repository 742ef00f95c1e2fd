"""SandboxFusion's `/run_code` JSON shapes, both ways (`../shared/SLIME_CONTRACT.md` §5).

Request: `{"code", "language", "stdin", "compile_timeout", "run_timeout", "memory_limit_MB", "files":
{path: base64}, "fetch_files"}`. Response: `{"status": "Success"|"Failed"|"SandboxError", "message",
"compile_result": null, "run_result": {"status": "Finished"|"Error"|"TimeLimitExceeded",
"execution_time", "return_code", "stdout", "stderr"}, "files": {}}`. Our server adds a `slime_env`
object with the exact status, reason and truncation; SandboxFusion clients ignore it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from slime_env.tools_sandbox.base import classify
from slime_env.tools_sandbox.types import ExecResult, decode_files

from slime_env.errors import InvalidInput

# "bash" runs /bin/sh (dash in our image): SandboxFusion clients name shell code "bash".
LANGUAGE_ALIASES = {"python": "python", "python3": "python", "shell": "shell", "sh": "shell", "bash": "shell"}


def parse_request(body: Any) -> dict[str, Any]:
    """`/run_code` body -> keyword arguments of `Sandbox.run`; InvalidInput naming the bad field."""
    if not isinstance(body, Mapping):
        raise InvalidInput("request body must be a JSON object")
    code = body.get("code")
    if not isinstance(code, str):
        raise InvalidInput("field 'code' is required and must be a string")
    language = body.get("language", "python")
    if language not in LANGUAGE_ALIASES:
        raise InvalidInput(f"field 'language': {language!r} is not supported here (supported: "
                           f"{sorted(LANGUAGE_ALIASES)})")
    stdin = body.get("stdin") or ""
    if not isinstance(stdin, str):
        raise InvalidInput("field 'stdin' must be a string")
    run_timeout = body.get("run_timeout", 10)
    if not isinstance(run_timeout, (int, float)) or isinstance(run_timeout, bool) or not 0 < run_timeout <= 3600:
        raise InvalidInput(f"field 'run_timeout' must be a number in (0, 3600], got {run_timeout!r}")
    memory = body.get("memory_limit_MB", -1)
    if not isinstance(memory, int) or isinstance(memory, bool) or (memory != -1 and memory < 16):
        raise InvalidInput(f"field 'memory_limit_MB' must be -1 or an integer >= 16, got {memory!r}")
    files = body.get("files") or {}
    if not isinstance(files, Mapping):
        raise InvalidInput("field 'files' must be an object of path -> base64 content")
    return {"code": code, "language": LANGUAGE_ALIASES[language], "stdin": stdin, "timeout_s": float(run_timeout),
            "memory_mb": None if memory == -1 else memory, "files": decode_files(files, "field 'files'")}


def to_response(result: ExecResult) -> dict[str, Any]:
    """An `ExecResult` in SandboxFusion's response shape (plus the exact status under `slime_env`)."""
    extra = {"status": result.status, "reason": result.reason, "truncated": result.truncated,
             "backend": result.backend}
    if result.status == "sandbox_error":
        return {"status": "SandboxError", "message": result.reason, "compile_result": None, "run_result": None,
                "files": {}, "slime_env": extra}
    run_status = "TimeLimitExceeded" if result.status == "timeout" else "Finished"
    return {"status": "Success" if result.status == "ok" else "Failed", "message": result.reason,
            "compile_result": None,
            "run_result": {"status": run_status, "execution_time": result.duration_s, "return_code": result.exit_code,
                           "stdout": result.stdout, "stderr": result.stderr},
            "files": {}, "slime_env": extra}


def from_response(body: Any, *, timeout_s: float, memory_mb: int, output_limit_bytes: int) -> ExecResult:
    """A `/run_code` response (ours or a real SandboxFusion server's) as an `ExecResult`."""
    if not isinstance(body, Mapping) or "status" not in body:
        return ExecResult("sandbox_error", reason=f"malformed /run_code response: {str(body)[:200]}", backend="remote")
    run = body.get("run_result") or {}
    extra = body.get("slime_env") or {}
    common = {"exit_code": run.get("return_code"), "stdout": run.get("stdout") or "",
              "stderr": run.get("stderr") or "", "duration_s": float(run.get("execution_time") or 0.0),
              "backend": f"remote:{extra.get('backend', 'sandboxfusion')}"}
    if extra.get("status"):
        return ExecResult(extra["status"], reason=extra.get("reason", ""), truncated=bool(extra.get("truncated")),
                          **common)
    if body["status"] == "SandboxError" or run.get("status") == "Error" or not run:
        return ExecResult("sandbox_error", reason=body.get("message") or "SandboxFusion reported SandboxError",
                          **common)
    status, reason = classify(exit_code=run.get("return_code"), timed_out=run.get("status") == "TimeLimitExceeded",
                              output_exceeded=False, oom=False, stderr=common["stderr"], timeout_s=timeout_s,
                              memory_mb=memory_mb, output_limit_bytes=output_limit_bytes)
    return ExecResult(status, reason=reason, **common)
