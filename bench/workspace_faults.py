"""1,000 workspace episodes with faults injected: nothing lost, nothing leaked.

Each task is one of: a normal episode (writes a file, submits: reward 1); a command that blows the workspace's
memory (OOM-killed: the tool says so, the episode goes on); a command that hangs (killed at the command timeout);
an agent killed mid-command (the episode's deadline passes while `sleep` runs: the command and the workspace go);
a verifier that hangs (its own timeout). The episodes run through the `RolloutManager` with a rollout store; the
whole run is killed with -9 part-way (16+ workspaces open), restarted with `resume`, and finishes.
At the end: every task has exactly one recorded trajectory with a status and a reason where it failed, and no
container, snapshot or network of ours is left (after the restart's pool reaped what the killed run left).
Usage: python bench/workspace_faults.py [--episodes 1000] [--concurrency 24] [--kill-after 60]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KINDS = ("normal", "oom", "hang", "killed", "verify_hang")
RUN_ID = "bench-faults"


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


COMMANDS = {"normal": "echo ok > /app/out.txt", "oom": "python3 -c 'b = bytearray(1 << 30)'",
            "hang": "sleep 1000", "killed": "sleep 1000", "verify_hang": "echo hang > /app/out.txt"}


def reply(context: str) -> str:
    """The scripted agent: the task's fault command, then submit."""
    kind = re.findall(r"FAULT:(\w+)", context)[-1]
    if context.count("<|im_start|>assistant") == 1:  # the first turn (SmolLM2's template)
        return call("bash", command=COMMANDS[kind], timeout=600 if kind == "killed" else 2)
    return call("submit")


def make_env_class():
    from slime_env.envs.workspace import WorkspaceEnv

    class FaultEnv(WorkspaceEnv):
        async def verify(self, task, ws):
            if "FAULT:verify_hang" in task.prompt:
                r = await ws.exec("sleep 1000", timeout_s=2)
                return 0.0, {"verify": r.status}
            try:
                return float(await ws.read_file("/app/out.txt") == b"ok\n"), {}
            except FileNotFoundError:
                return 0.0, {}

    return FaultEnv


async def child(out_dir: str, episodes: int, concurrency: int, image: str) -> None:
    from slime_env import RolloutManager, ScriptedPolicy, get_renderer
    from slime_env.offline_tokenizers import smollm2
    from slime_env.tools_sandbox.workspace import Limits, WorkspaceSpec
    from slime_env.tools_sandbox.workspace.pool import WorkspacePool

    tok = smollm2()
    tasks = [{"prompt": f"FAULT:{KINDS[i % len(KINDS)]} Do the task, then submit.", "metadata": {"i": i}}
             for i in range(episodes)]
    pool = WorkspacePool(warm=8, run=RUN_ID)
    spec = WorkspaceSpec(image=image, workdir="/app", limits=Limits(memory_mb=256, pids=128))
    FaultEnv = make_env_class()
    manager = RolloutManager(tasks, policy=ScriptedPolicy(tok, reply), renderer=get_renderer(tok),
                             env_factory=lambda task, _: FaultEnv(spec=spec, pool=pool, max_turns=4,
                                                                  command_timeout_s=600),
                             n_samples_per_prompt=1, max_concurrency=concurrency, max_turns=4, deadline_s=20,
                             out_dir=out_dir, resume=True)
    try:
        while manager.remaining():
            batch = await manager.generate_batch(min(50, manager.remaining()))
            print(f"batch: {len(batch.groups)} groups", flush=True)
    finally:
        await pool.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--kill-after", type=float, default=60.0, help="seconds before the first run is killed (-9)")
    ap.add_argument("--image", default="python:3.11-slim")
    ap.add_argument("--child", metavar="OUT_DIR")
    args = ap.parse_args()
    if args.child:
        asyncio.run(child(args.child, args.episodes, args.concurrency, args.image))
        return
    from slime_env.tools_sandbox.workspace.base_images import ensure_base_image
    from slime_env.tools_sandbox.workspace.docker import LABEL, RUN_LABEL, docker_client

    ensure_base_image(args.image)
    client = docker_client()

    def ours() -> int:
        return len(client.containers.list(all=True, filters={"label": [LABEL, f"{RUN_LABEL}={RUN_ID}"]},
                                       sparse=True))

    out = tempfile.mkdtemp(prefix="slime_env-faults-")
    argv = [sys.executable, "-P", __file__, "--child", out, "--episodes", str(args.episodes), "--concurrency",
            str(args.concurrency), "--image", args.image]
    t0 = time.time()
    first = subprocess.Popen(argv)
    time.sleep(args.kill_after)
    open_at_kill = ours()
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    print(f"killed the run with -9 after {args.kill_after:.0f} s: {open_at_kill} workspace containers open")
    second = subprocess.run(argv)
    wall = time.time() - t0
    assert second.returncode == 0, "the resumed run failed"
    rows = [json.loads(line) for line in Path(out, "groups.jsonl").read_text().splitlines()]
    trajectories = [t for row in rows for t in row["trajectories"]]
    seen = collections.Counter(t["task"]["metadata"]["i"] for t in trajectories)
    by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    unexplained = 0
    for t in trajectories:
        kind = re.findall(r"FAULT:(\w+)", t["task"]["prompt"])[0]
        by_kind[kind][(t["status"], t["reward"])] += 1
        unexplained += t["status"] not in ("completed",) and not t.get("reason")
    left = ours()
    print(f"{len(trajectories)} trajectories for {args.episodes} tasks in {wall:.0f} s; missing "
          f"{args.episodes - len(seen)}, duplicated {sum(1 for c in seen.values() if c > 1)}, "
          f"failed without a reason {unexplained}")
    for kind in KINDS:
        print(f"  {kind:12s} " + ", ".join(f"{s} reward {r:g}: {n}" for (s, r), n in sorted(by_kind[kind].items())))
    print(f"containers of the run left: {left}")
    assert len(seen) == args.episodes and all(c == 1 for c in seen.values()) and unexplained == 0 and left == 0


if __name__ == "__main__":
    main()
