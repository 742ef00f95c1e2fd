"""Engine servers the framework starts itself: `slime-env serve-engine` processes on this host, kept running.

`ServeProcess.start()` launches one and waits for its `listening on URL` line; `alive()` says whether it still
runs; `restart()` starts it again on the same port (its weights are then the model folder's, not the trainer's:
the engine pool keeps it out of rotation until the next weight sync reaches it). Its output goes to a log file.
It dies with the process that started it, kill -9 included (`slime_env.lifeline`).
Placement on other hosts (Ray actors that start these processes where their bundles are) is
`slime_env.trainers.run.placement`'s business; this module only runs a process.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from slime_env.lifeline import lifeline_popen


class EngineStartError(RuntimeError):
    """An engine process exited or stayed silent before it was serving."""


class ServeProcess:
    """One `slime-env serve-engine` process (see the module docstring). `args` are its extra CLI arguments."""

    def __init__(self, *, model: str, args: Sequence[str] = (), host: str = "127.0.0.1", port: int = 0,
                 log_path: str | Path | None = None, env: dict[str, str] | None = None, start_timeout_s: float = 300):
        self.model, self.args, self.host, self.port = model, list(args), host, port
        self.log_path = Path(log_path) if log_path else None
        self.env = env or {}
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.starts = 0

    def _command(self) -> list[str]:
        return [sys.executable, "-m", "slime_env", "serve-engine", "--model", self.model, "--host", self.host,
                "--port", str(self.port), *self.args]

    async def start(self) -> str:
        """Start the process; its URL once it serves."""
        return await asyncio.to_thread(self._start)

    def _start(self) -> str:
        log = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115 - kept open by the reader
        # The lifeline: the engine exits when this process is gone, however it ended (kill -9 included).
        self.proc = subprocess.Popen(self._command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     **lifeline_popen({**os.environ, "TOKENIZERS_PARALLELISM": "false", **self.env}))
        self.starts += 1
        found: list[str] = []
        ready = threading.Event()

        def pump() -> None:  # the pipe is read to the end whatever happens, so the process never blocks on it
            for raw in self.proc.stdout:
                if log is not None:
                    log.write(raw)
                    log.flush()
                line = raw.decode("utf-8", "replace").strip()
                if not found and line.startswith("listening on "):
                    found.append(line.split()[-1])
                    ready.set()
            ready.set()
            if log is not None:
                log.close()

        threading.Thread(target=pump, daemon=True, name=f"serve-engine-{self.port}").start()
        if not ready.wait(self.start_timeout_s) or not found:
            exited = self.proc.poll()
            self.stop()
            where = f" (its output: {self.log_path})" if self.log_path else ""
            what = f"exited with code {exited}" if exited is not None else \
                f"did not start within {self.start_timeout_s:g}s"
            raise EngineStartError(f"serve-engine --model {self.model} {what}{where}")
        self.url = found[0]
        self.port = int(self.url.rsplit(":", 1)[1])  # a restart takes the same port
        return self.url

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (the fault tests' way of losing an engine)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    async def restart(self) -> str:
        await asyncio.to_thread(self.stop)
        return await self.start()
