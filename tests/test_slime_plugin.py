"""The slime plug-in against objects with exactly slime's `Sample` fields and `Status` values, driven through
`slime-env serve-engine` speaking SGLang's protocol (the real SmolLM2 model on 127.0.0.1).

slime itself is not installable from PyPI (and SGLang cannot run here), so the Sample below mirrors
slime/utils/types.py field for field and our own server speaks SGLang's API; see ../shared/SLIME_CONTRACT.md.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import Enum
from types import SimpleNamespace
from typing import Any

import pytest
from slime_env.agents.default_model import default_model_path

from slime_env.integrations import slime as plugin
from helpers import serve_engine


@dataclass
class Sample:
    """slime.utils.types.Sample's fields (v0.3.x)."""

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: Any = None
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False
    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    train_metadata: dict | None = None
    session_id: str | None = None
    rollout_id: int | None = None
    non_generation_time: float = 0.0


def check_invariants(s: Sample) -> None:
    assert isinstance(s.status, Sample.Status) and s.status != Sample.Status.PENDING
    assert s.reward is not None and isinstance(float(s.reward), float)
    assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
    assert s.response_length <= len(s.tokens)
    assert all(m in (0, 1) for m in s.loss_mask)
    assert all(lp == 0.0 for lp, m in zip(s.rollout_log_probs, s.loss_mask) if m == 0)
    assert all(lp <= 0.0 for lp in s.rollout_log_probs)
    if s.remove_sample:
        assert s.reward == 0.0 and not any(s.loss_mask)
    assert isinstance(s.weight_versions, list) and isinstance(s.metadata["slime_env"], dict)


@pytest.fixture(scope="module")
def engine():
    with serve_engine("--max-batch-size", "16") as url:
        host, port = url.removeprefix("http://").split(":")
        yield host, int(port)


def make_args(engine, **config):
    host, port = engine
    return SimpleNamespace(sglang_router_ip=host, sglang_router_port=port, hf_checkpoint=str(default_model_path()),
                           rollout_max_response_len=48, rollout_max_context_len=2048, **config)


SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 48, "stop": None, "stop_token_ids": None,
            "skip_special_tokens": False, "no_stop_trim": True, "spaces_between_special_tokens": False}


def test_generate_fills_samples_that_satisfy_slimes_invariants(engine):
    args = make_args(engine, slime_env_id="Calculator-v0", slime_env_max_turns=3)
    samples = [Sample(group_index=i // 2, index=i, prompt=f"What is {i} + 2?", label=i + 2, rollout_id=7)
               for i in range(6)]

    async def main():
        try:
            return await asyncio.gather(*(plugin.generate(args, s, dict(SAMPLING)) for s in samples))
        finally:
            await plugin.close()

    out = asyncio.run(main())
    assert [s is o for s, o in zip(samples, out)] == [True] * 6  # filled in place
    for s in out:
        check_invariants(s)
        assert s.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)
        assert not s.remove_sample and any(s.loss_mask)
        assert s.tokens[-s.response_length:] and s.response  # the response is the tail of tokens
        assert len(s.metadata["slime_env"]["turn_rewards"]) >= 1
        assert s.non_generation_time >= 0.0 and s.session_id.startswith("slime-7-")
    rewards = asyncio.run(plugin.reward(args, out))
    assert rewards == [float(s.reward) for s in out]
    assert asyncio.run(plugin.reward(args, out[0])) == float(out[0].reward)
    assert asyncio.run(plugin.group_reward(args, out)) == rewards


def test_reward_functions_have_slimes_parameter_names():
    """slime's plug-in contract tests check `--custom-rm-path` functions by parameter name: `(args, sample)` for
    one sample, `(args, samples)` with `--group-rm` (THUDM/slime tests/plugin_contracts)."""
    import inspect

    from slime_env.envs.math import rewards as math_rewards

    for fn, names in ((plugin.reward, ["args", "sample"]), (plugin.group_reward, ["args", "samples"]),
                      (math_rewards.slime_reward, ["args", "sample"]),
                      (math_rewards.slime_group_reward, ["args", "samples"])):
        params = list(inspect.signature(fn).parameters)
        assert params[:2] == names, (fn.__qualname__, params)
        assert inspect.iscoroutinefunction(fn)


def run_one(args, sample, params):
    async def main():
        try:
            return await plugin.generate(args, sample, params)
        finally:
            await plugin.close()

    return asyncio.run(main())


def test_truncation_and_failures_come_back_in_safe_form(engine):
    short = make_args(engine, slime_env_id="Calculator-v0", slime_env_max_turns=1)
    params = {**SAMPLING, "max_new_tokens": 4}
    truncated = run_one(short, Sample(index=0, prompt="What is 2 + 2?", label=4), params)
    check_invariants(truncated)
    assert truncated.status == Sample.Status.TRUNCATED and truncated.response_length <= 4

    unknown = make_args(engine, slime_env_id="NoSuchEnv-v0")
    failed = run_one(unknown, Sample(index=1, prompt="x", label=1, tokens=[1, 2, 3]), dict(SAMPLING))
    assert failed.status == Sample.Status.FAILED and failed.remove_sample and failed.reward == 0.0
    assert failed.response_length == 0 and failed.loss_mask == [] and failed.rollout_log_probs == []
    assert "NoSuchEnv-v0" in failed.metadata["slime_env"]["status_reason"]
    bad_task = make_args(engine, slime_env_id="Math-v0")  # Math-v0 needs a label: the env raises at reset
    failed2 = run_one(bad_task, Sample(index=2, prompt="1+1?", label=None), dict(SAMPLING))
    check_invariants(failed2)
    assert failed2.status == Sample.Status.FAILED and failed2.remove_sample and failed2.reward == 0.0


def test_chat_prompts_and_the_dynamic_filter(engine):
    args = make_args(engine, slime_env_id="Math-v0", slime_env_kwargs={"system_prompt": None})
    sample = Sample(index=0, prompt=[{"role": "user", "content": "What is 3 + 4? Put the answer in \\boxed{}."}],
                    label="7")
    out = run_one(args, sample, dict(SAMPLING))
    check_invariants(out)
    assert out.status == Sample.Status.COMPLETED and out.reward in (0.0, 1.0)
    assert "verdict" in out.metadata["slime_env"]["info"]
    same = [Sample(reward=1.0), Sample(reward=1.0)]
    mixed = [Sample(reward=1.0), Sample(reward=0.0)]
    assert plugin.filter_nonzero_std(args, same) is False and plugin.filter_nonzero_std(args, mixed) is True


def test_multi_agent_env_returns_one_sample_per_trained_agent(engine):
    args = make_args(engine, slime_env_id="TicTacToe-v0", slime_env_max_turns=3,
                     slime_env_kwargs={"move_format": "tag_or_digit"})
    only_x = make_args(engine, slime_env_id="TicTacToe-v0", slime_env_max_turns=3, slime_env_train_agents=["x"])
    samples = [Sample(group_index=0, index=i, prompt="tic-tac-toe", rollout_id=None if i else 3) for i in range(3)]

    async def main():
        try:
            both = await asyncio.gather(*(plugin.generate(args, s, dict(SAMPLING)) for s in samples))
            x = await plugin.generate(only_x, Sample(group_index=1, index=9, prompt="tic-tac-toe"), dict(SAMPLING))
            return both, x
        finally:
            await plugin.close()

    both, x = asyncio.run(main())
    for original, siblings in zip(samples, both):
        assert isinstance(siblings, list) and len(siblings) == 2 and original not in siblings
        assert [s.metadata["slime_env"]["agent_id"] for s in siblings] == ["x", "o"]
        assert siblings[0].rollout_id == siblings[1].rollout_id is not None
        assert siblings[0].metadata["slime_env"]["episode_id"] == siblings[1].metadata["slime_env"]["episode_id"]
        for s in siblings:
            check_invariants(s)
        assert sum(s.reward for s in siblings) == 0  # zero-sum: both seats' outcomes
    assert both[0][0].rollout_id == 3  # slime's rollout id is kept when it has one
    assert [s.metadata["slime_env"]["agent_id"] for s in x] == ["x"]
