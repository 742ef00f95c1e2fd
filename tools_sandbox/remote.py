"""`RemoteSandbox`: runs code on a `slime-env serve-sandbox` or a real SandboxFusion server (`POST /run_code`)."""

from __future__ import annotations

import base64

from slime_env.tools_sandbox.base import Sandbox
from slime_env.tools_sandbox.fusion import from_response
from slime_env.tools_sandbox.languages import get_language
from slime_env.tools_sandbox.types import ExecRequest, ExecResult

from slime_env.http import HttpClient, RemoteError

REMOTE_LANGUAGE = {"python": "python", "shell": "bash"}  # SandboxFusion's names


class RemoteSandbox(Sandbox):
    """A sandbox server at `url`. 5xx answers (a full queue) and connection errors are retried: the code
    has not run then. `max_concurrency` caps this client's calls in flight."""

    backend = "remote"

    def __init__(self, url: str, *, max_concurrency: int = 64, max_retries: int = 3, **kw):
        super().__init__(max_concurrency=max_concurrency, **kw)
        self.url = url.rstrip("/")
        self.http = HttpClient(self.url, max_connections=max_concurrency, max_retries=max_retries)

    def describe(self) -> str:
        return f"remote sandbox at {self.url}"

    async def _execute(self, request: ExecRequest) -> ExecResult:
        get_language(request.language)
        body = {"code": request.code, "language": REMOTE_LANGUAGE.get(request.language, request.language),
                "stdin": request.stdin, "compile_timeout": request.timeout_s, "run_timeout": request.timeout_s,
                "memory_limit_MB": request.memory_mb,
                "files": {p: base64.b64encode(d).decode() for p, d in request.files.items()}, "fetch_files": []}
        try:
            answer = await self.http.request("POST", "/run_code", body)
        except RemoteError as e:
            return self._result("sandbox_error", reason=str(e)[:500])
        return from_response(answer, timeout_s=request.timeout_s, memory_mb=request.memory_mb,
                             output_limit_bytes=request.output_limit_bytes)

    async def close(self) -> None:
        await self.http.close()
