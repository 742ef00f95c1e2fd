"""`EnginePool`: one `Policy` over several engine servers (SGLang, `serve-engine`), with failover.

An episode sticks to one engine (its routing key hashes to it), so that engine's prefix cache holds the episode's
earlier turns. When an engine fails — its connection refused or reset after the client's retries, a 5xx answer, or
the health check (`/health_generate`, every `health_interval_s`, within `health_timeout_s`) marking it down while a
request waits on it — the engine leaves the rotation and the request is sent again, whole, to another engine: the
episode resumes from its last finished turn, and the failed attempt left nothing in its ledger (never lost, never
counted twice). A request the engine refused as malformed (4xx), or one the client refused before sending it (a
seed out of range: `InvalidInput`), is the caller's error and is raised; an engine that answers one request with a
5xx but passes its health check keeps its place (the failure was that request's): a request-level failure never
counts against an engine's health.

Engines have three states: `up` (serving), `down` (failed), `stale` (reachable again — restarted, or back from a
network fault — but holding weights older than the trainer's: it rejoins only when a weight sync has reached it,
`mark_synced`). `targets()` are the engines a weight sync must reach (up and stale). When no engine is up, a
request waits up to `wait_for_engine_s` for one to come back, then fails with that reason.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from slime_env.clients.session import EpisodeSession

from slime_env import Generation
from slime_env.http import RemoteError

UP, DOWN, STALE = "up", "down", "stale"


class NoEngine(RemoteError):
    """No engine is up to take a request."""


class EnginePool:
    """A `slime_env.Policy` over `engines` (`SGLangPolicy` clients); see the module docstring.

    `on_down(engine, reason)` is called (once per failure) when an engine leaves the rotation, e.g. to restart it.
    `failovers` counts requests sent again to another engine; `events` records (engine url, state, reason).
    """

    def __init__(self, engines: Sequence[Any], *, health_interval_s: float = 5.0, health_timeout_s: float = 60.0,
                 wait_for_engine_s: float = 600.0, on_down: Callable[[Any, str], Any] | None = None):
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        self.engines = list(engines)
        self.state = {e.url: UP for e in self.engines}
        self.health_interval_s, self.health_timeout_s = health_interval_s, health_timeout_s
        self.wait_for_engine_s = wait_for_engine_s
        self.on_down = on_down
        self.failovers = 0
        self.events: list[tuple[str, str, str]] = []
        self._live: dict[str, Any] = {}  # rid -> the engine running it
        self._down: dict[str, asyncio.Event] = {}  # per engine: set when it is marked down
        self._changed: asyncio.Event | None = None
        self._watch: asyncio.Task | None = None

    # --- the engines ------------------------------------------------------------------------------------------
    def up(self) -> list[Any]:
        return [e for e in self.engines if self.state[e.url] == UP]

    def targets(self) -> list[Any]:
        """The engines a weight sync must reach: every one that answers (up, or stale and waiting for it)."""
        return [e for e in self.engines if self.state[e.url] != DOWN]

    def mark_down(self, engine: Any, reason: str) -> None:
        if self.state.get(engine.url) == DOWN:
            return
        self.state[engine.url] = DOWN
        self.events.append((engine.url, DOWN, reason))
        self._event(engine).set()
        self._notify()
        if self.on_down is not None:
            self.on_down(engine, reason)

    def mark_stale(self, engine: Any, reason: str = "reachable again; waiting for the current weights") -> None:
        """An engine that answers again but has not got the trainer's weights (restarted, or back)."""
        if engine not in self.engines:
            self.engines.append(engine)
        self.state[engine.url] = STALE
        self._down.pop(engine.url, None)
        self.events.append((engine.url, STALE, reason))
        self._notify()

    def replace(self, old: Any, new: Any) -> None:
        """`new` (a client for a restarted engine, maybe at another address) takes `old`'s place, stale."""
        i = self.engines.index(old)
        self.engines[i] = new
        self.state.pop(old.url, None)
        self.mark_stale(new, "restarted; waiting for the current weights")

    def mark_synced(self, engines: Sequence[Any]) -> None:
        """These engines received the current weights: the stale ones rejoin the rotation."""
        for e in engines:
            if self.state.get(e.url) == STALE:
                self.state[e.url] = UP
                self.events.append((e.url, UP, "weights synced"))
        self._notify()

    # --- the Policy ---------------------------------------------------------------------------------------------
    async def generate(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any], *,
                       rid: str | None = None, routing_key: str | None = None) -> Generation:
        tried: set[str] = set()
        while True:
            engine = await self._pick(routing_key or rid or "", tried)
            if rid is not None:
                self._live[rid] = engine
            call = asyncio.ensure_future(engine.generate(input_ids, sampling_params, rid=rid,
                                                         routing_key=routing_key))
            down = asyncio.ensure_future(self._event(engine).wait())
            try:
                await asyncio.wait([call, down], return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                call.cancel()
                down.cancel()
                raise
            finally:
                if rid is not None:
                    self._live.pop(rid, None)
            down.cancel()
            if not call.done():  # the health check marked the engine down while this request waited on it
                call.cancel()
                tried.add(engine.url)
                self.failovers += 1
                continue
            try:
                return call.result()
            except RemoteError as e:
                if e.status is not None and e.status < 500:
                    raise  # the request's own fault: another engine would refuse it too
                if e.status is not None and await self._healthy(engine):
                    # It answered 5xx but still generates: a failure of this request (parameters it chokes on), not
                    # of the engine, which stays in the rotation. Another engine may take it; none left: raised.
                    tried.add(engine.url)
                    if all(u.url in tried for u in self.up()):
                        raise
                    self.failovers += 1
                    continue
                self.mark_down(engine, str(e))
            except (TimeoutError, OSError) as e:
                self.mark_down(engine, f"{type(e).__name__}: {e}")
            tried.add(engine.url)
            self.failovers += 1

    def for_episode(self, session_id: str) -> EpisodeSession:
        """A per-episode policy: its requests all go to one engine while it is up."""
        return EpisodeSession(self, session_id, routing_key=session_id)

    async def abort(self, rid: str) -> None:
        engine = self._live.get(rid)
        if engine is not None:
            await engine.abort(rid)

    async def abort_all(self) -> None:
        await asyncio.gather(*(e.abort_all() for e in self.up()), return_exceptions=True)

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        await asyncio.gather(*(e.close() for e in self.engines), return_exceptions=True)

    # --- health -------------------------------------------------------------------------------------------------
    async def check(self) -> None:
        """Probe every engine once: up ones that do not answer in time go down; down ones that answer go stale."""
        async def probe(e: Any) -> None:
            try:
                ok = await asyncio.wait_for(e.health(), self.health_timeout_s)
            except (TimeoutError, OSError, RemoteError):
                ok = False
            state = self.state.get(e.url)
            if state == UP and not ok:
                self.mark_down(e, f"health check failed (no answer within {self.health_timeout_s:g}s)")
            elif state == DOWN and ok:
                self.mark_stale(e)

        await asyncio.gather(*(probe(e) for e in list(self.engines)))

    def watch(self) -> None:
        """Probe every `health_interval_s` in the background (on the running loop) until `close()`."""
        if self._watch is None:
            self._watch = asyncio.ensure_future(self._watch_loop())

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.check()

    # --- internals ----------------------------------------------------------------------------------------------
    async def _healthy(self, engine: Any) -> bool:
        try:
            return bool(await asyncio.wait_for(engine.health(), self.health_timeout_s))
        except (TimeoutError, OSError, RemoteError):
            return False

    async def _pick(self, key: str, tried: set[str]) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_for_engine_s
        while True:
            candidates = [e for e in self.up() if e.url not in tried] or self.up()
            if candidates:
                # Sticky: the same key lands on the same engine while the set of engines is the same.
                return candidates[zlib.crc32(key.encode()) % len(candidates)]
            left = deadline - loop.time()
            if left <= 0:
                reasons = "; ".join(f"{u}: {r}" for u, s, r in self.events[-len(self.engines):] if s == DOWN)
                raise NoEngine(f"no engine is up (waited {self.wait_for_engine_s:g}s): {reasons}")
            changed = self._changed_event()
            changed.clear()
            try:
                await asyncio.wait_for(changed.wait(), min(left, 1.0))
            except TimeoutError:
                pass

    def _event(self, engine: Any) -> asyncio.Event:
        if engine.url not in self._down:
            self._down[engine.url] = asyncio.Event()
        return self._down[engine.url]

    def _changed_event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
