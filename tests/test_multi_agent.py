"""Multi-agent episodes: one exact token ledger per agent (strict renderer, real tokenizer), turn-based and
simultaneous moves, zero-sum rewards, an agent out mid-episode, failures recorded per agent, shared
and separate policies, a built-in bot seat."""

from __future__ import annotations

import re

import pytest
from slime_env.envs.games import RockPaperScissorsEnv, TicTacToeEnv

from slime_env import Message, MultiAgentEnv, ScriptedPolicy, get_renderer, run_multi_agent_episode


def first_free_cell(context: str) -> str:
    board = re.findall(r"Board:\n([^\n]+)\n([^\n]+)\n([^\n]+)", context)[-1]
    free = [c for row in board for c in row.split() if c.isdigit()]
    return f"I take {free[0]}. <move>{free[0]}</move>"


def play(runner, env, policies, tok, **kw):
    return runner.run(run_multi_agent_episode(env, policies, "play", renderer=get_renderer(tok, strict=True), **kw))


def assert_exact(traj, tok):
    traj.check()  # ids, mask, log-probs and spans line up
    assert not traj.metadata.get("history_rewrites")
    generated = [t for t, m in zip(traj.response_ids, traj.loss_mask) if m]
    replies = [m.content for m in traj.messages if m.role == "assistant"]
    assert len(replies) == traj.num_turns
    assert tok.decode(generated).count("<move>") == len(replies)


def test_turn_based_game_keeps_one_exact_ledger_per_agent(runner, smollm2_tok):
    env = TicTacToeEnv()
    trajs = play(runner, env, ScriptedPolicy(smollm2_tok, first_free_cell), smollm2_tok)
    assert set(trajs) == {"x", "o"}
    x, o = trajs["x"], trajs["o"]
    for t in (x, o):
        assert_exact(t, smollm2_tok)
        assert t.status == "completed" and t.metadata["episode_id"] == x.metadata["episode_id"]
    # first-free-cell play: X takes 1, O 2, X 3, O 4, X 5, O 6, X 7 -> X wins on the diagonal 3-5-7
    assert x.info["moves"] == ["x1", "o2", "x3", "o4", "x5", "o6", "x7"] and x.info["winner"] == "x"
    assert (x.reward, o.reward) == (1.0, -1.0) and x.num_turns == 4 and o.num_turns == 3
    assert x.metadata["role"] == "x" and o.metadata["role"] == "o"
    # each agent saw the other's move only as inserted tokens, and the final board only in its record
    o_inserted = smollm2_tok.decode([t for t, m in zip(o.response_ids, o.loss_mask) if not m])
    assert "X played 3." in o_inserted and "X wins." not in o_inserted
    assert o.messages[-1].content.endswith("X wins.")


def test_illegal_moves_lose_and_rewards_sum_to_zero(runner, smollm2_tok):
    trajs = play(runner, TicTacToeEnv(), ScriptedPolicy(smollm2_tok, ["<move>5</move>"]), smollm2_tok)
    assert trajs["o"].reward == -1.0 and trajs["x"].reward == 1.0  # O repeats the taken cell 5
    assert "cell 5 is taken" in trajs["o"].messages[-1].content
    assert sum(t.reward for t in trajs.values()) == 0


def test_simultaneous_moves_are_generated_concurrently(runner, smollm2_tok):
    in_flight, most = [0], [0]

    class Counting:
        """Wraps a policy and counts its generate calls running at once (no clock involved)."""

        def __init__(self, inner):
            self.inner = inner

        async def generate(self, input_ids, sampling_params):
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
            try:
                return await self.inner.generate(input_ids, sampling_params)
            finally:
                in_flight[0] -= 1

    env = RockPaperScissorsEnv(rounds=3)
    rock = ScriptedPolicy(smollm2_tok, ["<move>rock</move>"], latency_s=0.01)
    cycle = ScriptedPolicy(smollm2_tok, ["<move>paper</move>", "<move>rock</move>", "<move>scissors</move>"],
                           latency_s=0.01)
    trajs = play(runner, env, {"player_0": Counting(rock), "player_1": Counting(cycle)}, smollm2_tok)
    p0, p1 = trajs["player_0"], trajs["player_1"]
    assert p0.turn_rewards == [-1.0, 0.0, 1.0] and p1.turn_rewards == [1.0, 0.0, -1.0]
    assert p0.num_turns == p1.num_turns == 3 and rock.calls == cycle.calls == 3  # each policy, its own agent
    for t in trajs.values():
        assert_exact(t, smollm2_tok)
    assert most[0] == 2  # both agents' generations were in flight at once


class Elimination(MultiAgentEnv):
    """Three agents say numbers each round; after round 1 the lowest is out, and is paid at the end."""

    agents = ("a", "b", "c")

    async def reset(self, *, seed=None, options=None):
        self.round, self.out = 0, set()
        return {a: [Message("system", "Say a number."), Message("user", "Round 1.")] for a in self.agents}, {}

    def acting(self):
        return [a for a in self.agents if a not in self.out] if self.round < 3 else []

    async def step(self, actions):
        self.round += 1
        said = {a: int(re.findall(r"\d+", act.text)[-1]) for a, act in actions.items()}
        terminated, rewards = {}, {}
        if self.round == 1:
            low = min(said, key=said.get)
            self.out.add(low)
            terminated[low] = True
        if self.round == 3:
            rewards = {a: 1.0 for a in self.agents}  # everyone, the eliminated one too
            terminated = {a: True for a in self.agents}
        obs = {a: [Message("user", f"Round {self.round + 1}.")] for a in self.agents if a not in self.out}
        return obs, rewards, terminated, {}, {}


def test_an_agent_out_mid_episode_keeps_its_ledger_and_its_reward(runner, smollm2_tok):
    numbers = {"a": "1", "b": "2", "c": "3"}
    policies = {a: ScriptedPolicy(smollm2_tok, [n]) for a, n in numbers.items()}
    trajs = play(runner, Elimination(), policies, smollm2_tok)
    assert [trajs[a].num_turns for a in "abc"] == [1, 3, 3]
    assert all(t.status == "completed" and t.reward == 1.0 for t in trajs.values())
    assert trajs["a"].turn_rewards == [1.0]  # paid after it was out: added to its last turn
    for t in trajs.values():
        t.check()


def test_a_failing_policy_fails_its_agent_and_aborts_the_others(runner, smollm2_tok):
    class Broken:
        async def generate(self, input_ids, sampling_params):
            raise RuntimeError("engine down")

    trajs = play(runner, TicTacToeEnv(), {"x": ScriptedPolicy(smollm2_tok, first_free_cell), "o": Broken()},
                 smollm2_tok)
    assert trajs["o"].status == "failed" and "engine down" in trajs["o"].reason
    assert trajs["x"].status == "aborted" and "'o' failed" in trajs["x"].reason
    assert trajs["x"].num_turns == 1
    trajs["x"].check()


def test_a_failing_env_fails_every_agent(runner, smollm2_tok):
    class Exploding(TicTacToeEnv):
        async def step(self, actions):
            raise ValueError("board on fire")

    trajs = play(runner, Exploding(), ScriptedPolicy(smollm2_tok, first_free_cell), smollm2_tok)
    assert all(t.status == "failed" and "env.step raised ValueError: board on fire" in t.reason
               for t in trajs.values())


def test_bad_env_output_is_named(runner, smollm2_tok):
    class Silent(RockPaperScissorsEnv):
        async def step(self, actions):
            obs, rewards, terminated, truncated, info = await super().step(actions)
            return {}, rewards, terminated, truncated, info  # nobody is shown the round

    trajs = play(runner, Silent(rounds=2), ScriptedPolicy(smollm2_tok, ["<move>rock</move>"]), smollm2_tok)
    assert all(t.status == "failed" and "was shown nothing since its last turn" in t.reason for t in trajs.values())


def test_a_bot_plays_a_seat(runner, smollm2_tok):
    trajs = play(runner, TicTacToeEnv(bot={"o": "perfect"}), ScriptedPolicy(smollm2_tok, first_free_cell),
                 smollm2_tok, seed=0)
    assert set(trajs) == {"x"}
    x = trajs["x"]
    assert x.status == "completed" and x.reward == -1.0 and x.info["winner"] == "o"  # first-free-cell loses
    assert_exact(x, smollm2_tok)


def test_max_turns_and_deadline_truncate_every_agent(runner, smollm2_tok):
    trajs = play(runner, RockPaperScissorsEnv(rounds=5), ScriptedPolicy(smollm2_tok, ["<move>rock</move>"]),
                 smollm2_tok, max_turns=2)
    assert all(t.status == "truncated" and "max_turns=2" in t.reason and t.num_turns == 2 for t in trajs.values())
    slow = ScriptedPolicy(smollm2_tok, ["<move>rock</move>"], latency_s=5.0)
    trajs = play(runner, RockPaperScissorsEnv(), slow, smollm2_tok, deadline_s=0.3)
    assert all(t.status == "truncated" and "deadline" in t.reason for t in trajs.values())


@pytest.mark.parametrize("seed", range(5))
def test_random_games_keep_every_ledger_exact(runner, smollm2_tok, seed):
    import random

    rng = random.Random(seed)

    def random_player(context: str) -> str:
        board = re.findall(r"Board:\n([^\n]+)\n([^\n]+)\n([^\n]+)", context)[-1]
        free = [c for row in board for c in row.split() if c.isdigit()]
        return f"{'Hmm. ' * rng.randrange(3)}<move>{rng.choice(free)}</move>{' ok' * rng.randrange(2)}"

    trajs = play(runner, TicTacToeEnv(), ScriptedPolicy(smollm2_tok, random_player), smollm2_tok)
    assert sum(t.reward for t in trajs.values()) == 0
    for t in trajs.values():
        assert t.status == "completed"
        assert_exact(t, smollm2_tok)


def test_shared_policy_serves_both_seats(runner, smollm2_tok):
    shared = ScriptedPolicy(smollm2_tok, first_free_cell)
    trajs = play(runner, TicTacToeEnv(), shared, smollm2_tok)
    assert shared.calls == sum(t.num_turns for t in trajs.values()) == 7



def test_rollout_manager_groups_each_trained_agents_samples(runner, smollm2_tok):
    from slime_env import RolloutManager

    def run(train_agents):
        manager = RolloutManager(["play"] * 2, env_id="TicTacToe-v0",
                                 policy=ScriptedPolicy(smollm2_tok, first_free_cell),
                                 renderer=get_renderer(smollm2_tok), n_samples_per_prompt=3, max_turns=6,
                                 train_agents=train_agents)
        batch = runner.run(manager.generate_batch(2))
        runner.run(manager.close())
        return batch

    both = run(None)
    for group in both.groups:
        assert [t.agent_id for t in group.trajectories] == ["x"] * 3 + ["o"] * 3  # one GRPO group per agent
        assert [t.metadata["sample_index"] for t in group.trajectories] == [0, 1, 2] * 2
        assert group.trajectories[0].metadata["episode_id"] == group.trajectories[3].metadata["episode_id"]
    only_o = run(["o"])
    assert all([t.agent_id for t in g.trajectories] == ["o"] * 3 for g in only_o.groups)


def test_cooperative_taboo_rewards_both_and_hides_the_word(runner, smollm2_tok):
    from slime_env.envs.games import TabooEnv

    describer = ScriptedPolicy(smollm2_tok, ["A red or green fruit that keeps doctors away."])
    guesser = ScriptedPolicy(smollm2_tok, ["<guess>cherry</guess>", "<guess>Apple</guess>"])
    trajs = runner.run(run_multi_agent_episode(TabooEnv(), {"describer": describer, "guesser": guesser},
                                               {"prompt": "taboo", "label": "apple"},
                                               renderer=get_renderer(smollm2_tok, strict=True)))
    d, g = trajs["describer"], trajs["guesser"]
    assert d.reward == g.reward == 1.0 and d.num_turns == 2 and g.num_turns == 2
    assert "apple" not in smollm2_tok.decode(g.prompt_ids + g.response_ids).lower().replace("<guess>apple", "")
    for t in trajs.values():
        t.check()
    cheat = ScriptedPolicy(smollm2_tok, ["The word is apple."])
    lost = runner.run(run_multi_agent_episode(TabooEnv(), {"describer": cheat, "guesser": guesser},
                                              {"prompt": "taboo", "label": "apple"},
                                              renderer=get_renderer(smollm2_tok)))
    assert lost["describer"].reward == lost["guesser"].reward == 0.0 and lost["guesser"].num_turns == 0


def test_negotiation_pays_each_side_its_private_values(runner, smollm2_tok):
    from slime_env.envs.games import SplitItemsEnv

    env = SplitItemsEnv()
    a = ScriptedPolicy(smollm2_tok, ["<propose>books=0 hats=0 balls=0</propose>"])  # gives everything away
    b = ScriptedPolicy(smollm2_tok, ["<accept/>"])
    trajs = runner.run(run_multi_agent_episode(env, {"a": a, "b": b}, "negotiate", renderer=get_renderer(smollm2_tok),
                                               seed=3))
    assert trajs["a"].reward == 0.0 and trajs["b"].reward == 1.0  # b's whole pool is worth 10/10 to b
    assert trajs["a"].info["deal"]["b"] == env.pool
    # b never saw a's values: its prompt holds its own values only
    b_text = smollm2_tok.decode(trajs["b"].prompt_ids)
    values_b = ", ".join(f"{k}={v}" for k, v in env.values["b"].items())
    assert values_b in b_text and ", ".join(f"{k}={v}" for k, v in env.values["a"].items()) not in b_text \
        or env.values["a"] == env.values["b"]
    rude = ScriptedPolicy(smollm2_tok, ["no"])
    none = runner.run(run_multi_agent_episode(SplitItemsEnv(), rude, "negotiate", renderer=get_renderer(smollm2_tok)))
    assert none["a"].reward == none["b"].reward == 0.0 and none["b"].num_turns == 0


def test_opponent_pool_picks_one_opponent_per_episode_reproducibly(runner, smollm2_tok):
    from slime_env.trainers import OpponentPool

    from slime_env import RolloutManager

    live = ScriptedPolicy(smollm2_tok, first_free_cell)
    old = [ScriptedPolicy(smollm2_tok, first_free_cell) for _ in range(3)]
    pool = OpponentPool(live, size=2, latest_p=0.0, seed=1)
    assert pool.opponent(0) is live  # no snapshot yet: self-play
    for p in old:
        pool.add(p)
    assert list(pool.snapshots) == old[1:]  # the oldest left first
    picks = [pool.opponent(i) for i in range(40)]
    assert picks == [pool.opponent(i) for i in range(40)] and set(map(id, picks)) == {id(old[1]), id(old[2])}
    assert OpponentPool(live, latest_p=1.0).opponent(3) is live

    manager = RolloutManager(["play"], env_id="TicTacToe-v0", policy=live, renderer=get_renderer(smollm2_tok),
                             n_samples_per_prompt=4, max_turns=6, train_agents=["x"],
                             policy_for=lambda index, agent: pool.opponent(index) if agent == "o" else None)
    batch = runner.run(manager.generate_batch(1))
    runner.run(manager.close())
    assert [t.agent_id for t in batch.groups[0].trajectories] == ["x"] * 4
    assert live.calls == 4 * 4 and old[1].calls + old[2].calls == 4 * 3  # x: 4 moves a game; o: 3, by the pool


def test_snapshots_are_frozen_copies_of_a_local_engine(runner):
    import torch
    from slime_env.agents.policy_loader import load_policy
    from slime_env.trainers import snapshot

    engine, _ = load_policy("default", max_batch_size=2)
    copy = snapshot(engine, version="step-0")
    try:
        before = next(copy.model.parameters()).detach().clone()
        with torch.no_grad():
            next(engine.model.parameters()).add_(1.0)  # the live policy moves on
        assert torch.equal(next(copy.model.parameters()), before) and copy.weight_version == "step-0"
    finally:
        copy.close()
        engine.close()


def test_train_config_names_a_bad_opponent_pool():
    from slime_env.trainers import TrainConfig

    from slime_env.errors import InvalidInput

    with pytest.raises(InvalidInput, match="opponent_pool needs 'agents'"):
        TrainConfig.from_dict({"env": "TicTacToe-v0", "opponent_pool": {"size": 2}}, "cfg.yaml")
    assert TrainConfig.from_dict({"opponent_pool": {"agents": ["o"], "every": 3}}).opponent_pool["every"] == 3


def test_every_game_has_a_built_in_opponent_for_evaluation(runner, smollm2_tok):
    from slime_env.envs.games import SplitItemsEnv, TabooEnv

    rps = play(runner, RockPaperScissorsEnv(rounds=3, bot={"player_1": "cycle"}),
               ScriptedPolicy(smollm2_tok, ["<move>paper</move>"]), smollm2_tok)
    assert set(rps) == {"player_0"} and rps["player_0"].turn_rewards == [1.0, 0.0, -1.0]  # vs rock, paper, scissors
    guesser = ScriptedPolicy(smollm2_tok,
                             lambda ctx: "<guess>" + re.findall(r"starts with '(\w+)'", ctx)[-1] + "</guess>")
    taboo = runner.run(run_multi_agent_episode(TabooEnv(rounds=6, bot={"describer": "letters"}), guesser,
                                               {"prompt": "taboo", "label": "tiger"},
                                               renderer=get_renderer(smollm2_tok, strict=True)))
    assert set(taboo) == {"guesser"} and taboo["guesser"].reward == 1.0 and taboo["guesser"].num_turns == 5
    taboo["guesser"].check()
    generous = SplitItemsEnv(bot={"b": "fair"})
    gift = play(runner, generous, ScriptedPolicy(smollm2_tok, ["<propose>books=0 hats=0 balls=0</propose>"]),
                smollm2_tok, seed=5)
    assert set(gift) == {"a"} and gift["a"].reward == 0.0 and gift["a"].info["deal"]["b"] == generous.pool

    def keep_all_then_accept(context: str) -> str:
        if "They propose" in context:
            return "<accept/>"
        counts = dict((k, n) for n, k in re.findall(r"(\d+) (books|hats|balls)", context.split("Your values")[0]))
        return f"<propose>books={counts['books']} hats={counts['hats']} balls={counts['balls']}</propose>"

    greedy = SplitItemsEnv(bot={"b": "fair"})
    deal = play(runner, greedy, ScriptedPolicy(smollm2_tok, keep_all_then_accept), smollm2_tok, seed=5)["a"]
    share = deal.info["deal"]  # the bot refused a share worth 0 and countered with one worth >= 6 to it
    assert sum(share["b"][k] * greedy.values["b"][k] for k in share["b"]) >= 6
    assert deal.reward == sum(share["a"][k] * greedy.values["a"][k] for k in share["a"]) / 10 and deal.num_turns == 2


def test_every_negotiation_seed_has_a_pool_worth_ten(runner):
    from slime_env.envs.games import SplitItemsEnv

    env = SplitItemsEnv()
    for seed in range(300):  # a pool of 3 of each item once made reset loop forever
        runner.run(env.reset(seed=seed))
        assert all(sum(env.pool[k] * v[k] for k in env.pool) == 10 for v in env.values.values())


class _PlannedRPS(RockPaperScissorsEnv):
    """Its sampling params (`MultiAgentEnv.sampling_params`) come from the task: one mapping for all, or per agent."""

    def __init__(self, plan, **kw):
        super().__init__(**kw)
        self.plan = plan

    async def reset(self, *, seed=None, options=None):
        out = await super().reset(seed=seed, options=options)
        self.sampling_params = self.plan
        return out


def test_an_envs_sampling_params_reach_every_agent_or_each_its_own(runner, smollm2_tok):
    """Set in reset, merged over the run's for every agent (or per agent id: a greedy opponent), the env's
    max_new_tokens lowering that agent's per-turn budget; a bad value fails every agent, naming the agent's entry."""
    from helpers import RecordingPolicy

    def seats():
        return {a: RecordingPolicy(ScriptedPolicy(smollm2_tok, ["<move>rock</move>"]))
                for a in ("player_0", "player_1")}

    run_params = {"temperature": 1.0, "top_p": 0.9}
    for plan, want in (
            ({"max_new_tokens": 9, "top_k": 5}, {a: (9, 1.0, 5) for a in ("player_0", "player_1")}),
            ({"player_1": {"temperature": 0.0, "max_new_tokens": 64}},  # above the run's 32: the run's bounds it
             {"player_0": (32, 1.0, None), "player_1": (32, 0.0, None)})):
        policies = seats()
        trajs = play(runner, _PlannedRPS(plan, rounds=2), policies, smollm2_tok, max_new_tokens=32,
                     sampling_params=run_params)
        assert all(t.status == "completed" for t in trajs.values()), {a: t.reason for a, t in trajs.items()}
        for a, policy in policies.items():
            assert len(policy.params) == 2 and all(p["top_p"] == 0.9 for p in policy.params)
            assert {(p["max_new_tokens"], p["temperature"], p.get("top_k")) for p in policy.params} == {want[a]}, a
    assert run_params == {"temperature": 1.0, "top_p": 0.9}  # the run's mapping is not written to
    trajs = play(runner, _PlannedRPS({"player_0": {"max_new_tokens": 0}}, rounds=2), seats(), smollm2_tok)
    assert {t.status for t in trajs.values()} == {"failed"}
    assert all("_PlannedRPS.sampling_params['player_0']['max_new_tokens']: expected a positive integer, got 0"
               in t.reason for t in trajs.values()), [t.reason for t in trajs.values()]
