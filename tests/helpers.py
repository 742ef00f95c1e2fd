"""Small envs and policies used by several test modules."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence

from slime_env import Env, Generation, Message, Task
from slime_env.ledger import Span
from slime_env.trajectory import Trajectory


class ScriptedEnv(Env):
    """Returns pre-scripted observations, one list per step; terminates after the last one.

    Reward of step k is `rewards[k]` (default 0.0, and 1.0 on the final step).
    """

    parser = "hermes"

    def __init__(self, observations: Sequence[Sequence[Message]] = (), rewards: Sequence[float] | None = None,
                 prompt: Sequence[Message] | None = None, fail_at: int | None = None):
        self.observations = [list(o) for o in observations]
        self.rewards = list(rewards) if rewards is not None else None
        self.prompt = list(prompt) if prompt is not None else None
        self.fail_at = fail_at
        self.actions = []
        self.closed = False

    async def reset(self, *, seed=None, options=None):
        task = self.task_from(options)
        self.actions = []
        return (self.prompt if self.prompt is not None else task.messages()), {"seed": seed}

    async def step(self, action):
        k = len(self.actions)
        self.actions.append(action)
        if self.fail_at == k:
            raise RuntimeError(f"env exploded at step {k}")
        last = k >= len(self.observations)
        obs = [] if last else self.observations[k]
        if self.rewards is not None:
            reward = self.rewards[k] if k < len(self.rewards) else 0.0
        else:
            reward = 1.0 if last else 0.0
        return obs, reward, last, False, {"step": k}

    async def close(self):
        self.closed = True


class RecordingPolicy:
    """Wraps a policy and records a copy of every input it was given."""

    def __init__(self, inner):
        self.inner = inner
        self.inputs: list[list[int]] = []
        self.params: list[dict] = []

    async def generate(self, input_ids, sampling_params) -> Generation:
        self.inputs.append(list(input_ids))
        self.params.append(dict(sampling_params))
        return await self.inner.generate(input_ids, sampling_params)


class FixedIdsPolicy:
    """Returns given token ids (e.g. a non-canonical tokenization) with fixed log-probs."""

    def __init__(self, turns: Sequence[Sequence[int]], finish_reason: str = "stop"):
        self.turns = [list(t) for t in turns]
        self.finish_reason = finish_reason
        self.calls = 0

    async def generate(self, input_ids, sampling_params) -> Generation:
        ids = self.turns[min(self.calls, len(self.turns) - 1)]
        self.calls += 1
        return Generation(tuple(ids), tuple(-0.5 for _ in ids), self.finish_reason)


def task(prompt: str = "Hello?", label=None) -> Task:
    return Task(prompt=prompt, label=label)


class LocalServer:
    """Serves an aiohttp app on 127.0.0.1 (a free port) inside the test's event loop; `.url` once entered."""

    def __init__(self, app):
        self.app = app

    async def __aenter__(self):
        from aiohttp import web

        self.runner = web.AppRunner(self.app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


@contextlib.contextmanager
def serve_engine(*args: str, timeout_s: float = 180.0) -> Iterator[str]:
    """`slime-env serve-engine` (the real SmolLM2 model, SGLang's HTTP API) in a subprocess; yields its URL."""
    from slime_env.agents.default_model import default_model_path

    default_model_path()  # convert once here, not inside the server's start-up wait
    proc = subprocess.Popen([sys.executable, "-m", "slime_env", "serve-engine", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    url, deadline, seen = None, time.time() + timeout_s, []
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if line.startswith("listening on "):
            url = line.split()[-1]
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # never let its pipe fill up
            break
    if url is None:
        proc.kill()
        raise RuntimeError("serve-engine did not start:\n" + "".join(seen[-30:]))
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# --- tiny models and synthetic trajectories for the trainer tests --------------------------------------

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


def tiny(family: str, seed: int = 0):
    """A random 2-layer HF model of `family` ("llama" tied, "qwen2" qkv bias, "qwen3" q/k norm, "qwen3_moe": 3
    layers, the middle one dense, 4 experts top-2, renormalised; "qwen3_moe_raw": the same unrenormalised) at a
    trained model's weight scale."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    moe = dict(SHAPE, num_hidden_layers=3, head_dim=24, tie_word_embeddings=False, moe_intermediate_size=40,
               num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1])
    cls, cfg = {"llama": (LlamaForCausalLM, LlamaConfig(**SHAPE, tie_word_embeddings=True)),
                "qwen2": (Qwen2ForCausalLM, Qwen2Config(**SHAPE, tie_word_embeddings=False)),
                "qwen3": (Qwen3ForCausalLM, Qwen3Config(**SHAPE, head_dim=24, tie_word_embeddings=False)),
                "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**moe, norm_topk_prob=True)),
                "qwen3_moe_raw": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**moe, norm_topk_prob=False))}[family]
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # random weights of a trained model's scale, biases and norms included
        for p in model.parameters():
            p.normal_(0.0, 0.15).add_(1.0 if p.dim() == 1 and p.shape[0] in (SHAPE["hidden_size"], 24) else 0.0)
    return model


def trajectories(n: int, seed: int = 0, vocab: int = 96) -> list[Trajectory]:
    """Random multi-turn-shaped trajectories: generated spans (mask 1) and inserted spans (mask 0)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 9))]
        response, mask, spans = [], [], []
        for turn in range(rng.randint(1, 3)):
            for kind in ("generated", "inserted"):
                k = rng.randint(1, 6)
                spans.append(Span(turn, kind, len(response), len(response) + k))
                response += [rng.randrange(vocab) for _ in range(k)]
                mask += [1 if kind == "generated" else 0] * k
        logps = [-rng.random() * 3 if m else 0.0 for m in mask]
        out.append(Trajectory(task=Task(prompt="p"), prompt_ids=prompt, response_ids=response, loss_mask=mask,
                              rollout_logprobs=logps, spans=spans, turn_rewards=[float(i % 2)], reward=float(i % 2),
                              status="completed"))
    return out


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_DIST_RESULTS: dict[tuple, dict] = {}


def run_dist_check(tmp_path, nproc: int, tp: int = 1, *extra: str, ep: int = 1, cp: int = 1) -> dict:
    """tests/dist_check.py in `nproc` gloo processes (torchrun; alone for 1) with TP size `tp`, EP size `ep`, CP
    size `cp` and `extra` flags (--sp, --moe, --pp N, --layers N, --tied, --backend B, --recompute R, --failed N);
    its JSON result. The run is deterministic (seeded model and data, fp32 on CPU), so a case several tests compare
    against (the one-process references) runs once per pytest process."""
    import json

    key = (nproc, tp, ep, cp, *extra)
    if key in _DIST_RESULTS:
        return _DIST_RESULTS[key]
    out = tmp_path / f"dist_{nproc}_{tp}_{ep}_{cp}{''.join(extra)}.json"
    script = [os.path.join(_ROOT, "tests", "dist_check.py"), "--tp", str(tp), "--ep", str(ep), "--cp", str(cp), *extra,
              "--out", str(out)]
    # TMPDIR: torchrun's own folders (torchelastic_*) go with the test's tmp_path, not into /tmp
    env = {**os.environ, "PYTHONPATH": _ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tmp_path)}
    proc = run_ranks(nproc, script, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _DIST_RESULTS[key] = json.loads(out.read_text())
    return _DIST_RESULTS[key]


# what every rank of tests/dist_check.py imports (tests/fork_ranks.py imports it once for all ranks)
DIST_CHECK_IMPORTS = ("torch.distributed", "transformers", "slime_env.trainers.batch",
                      "slime_env.trainers.torch_trainer", "slime_env.trainers.fsdp_trainer",
                      "slime_env.trainers.megatron_trainer", "slime_env.trainers.megatron.attention", "helpers")


class RankServer:
    """tests/fork_ranks.py: launches of a script's ranks forked from one process that imported
    `DIST_CHECK_IMPORTS` once (started at the first launch, stopped after each test module by conftest)."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": _ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, os.path.join(_ROOT, "tests", "fork_ranks.py"),
                                      "--preload", ",".join(DIST_CHECK_IMPORTS)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=_ROOT, env=env)

    def run(self, nproc: int, argv: list[str], *, env: dict, timeout: float, cwd: str = _ROOT
            ) -> subprocess.CompletedProcess:
        import json
        import select
        import signal
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            out, err = os.path.join(d, "out"), os.path.join(d, "err")
            self.proc.stdin.write(json.dumps({"nproc": nproc, "argv": argv, "env": dict(env), "cwd": cwd,
                                              "stdout": out, "stderr": err}) + "\n")
            self.proc.stdin.flush()
            leader = json.loads(self.proc.stdout.readline())["pid"]
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            if not ready:  # the whole launch (its session: leader and ranks), as run_group does
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(leader, signal.SIGKILL)
            code = json.loads(self.proc.stdout.readline())["code"]
            stdout, stderr = (open(f).read() for f in (out, err))
        if not ready:
            raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
        return subprocess.CompletedProcess(argv, code, stdout, stderr)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_RANK_SERVER: RankServer | None = None


def run_ranks(nproc: int, script: list[str], *, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`script` ([path, args...]) in `nproc` ranks (one: alone), its output captured: on CPUs forked by this
    process's `RankServer`, with CUDA under torchrun (a forked CUDA context is unusable)."""
    global _RANK_SERVER
    import torch

    if torch.cuda.is_available():
        cmd = [sys.executable, *script] if nproc == 1 else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script]
        return run_group(cmd, cwd=_ROOT, env=env, timeout=timeout)
    if _RANK_SERVER is None or _RANK_SERVER.proc.poll() is not None:
        _RANK_SERVER = RankServer()
    return _RANK_SERVER.run(nproc, list(script), env=env, timeout=timeout)


def stop_rank_server() -> None:
    """The rank server's process ends (after each test module: its imports are ~0.5 GB the next module may not need)."""
    global _RANK_SERVER
    if _RANK_SERVER is not None:
        _RANK_SERVER.close()
        _RANK_SERVER = None


def run_group(cmd: list[str], *, timeout: float, **kw) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)` in a session of its own; on a timeout every process of
    the session is killed (torchrun's ranks too: a SIGKILL to torchrun alone would leave them running), then
    `TimeoutExpired` is raised as `subprocess.run` raises it."""
    import signal

    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          **kw) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            e.stdout, e.stderr = proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def same_weights(a: dict, b: dict) -> None:
    """Two runs' per-weight sums (dist_check's `weight_sums`) agree to fp32 rounding."""
    import pytest

    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-4), k
