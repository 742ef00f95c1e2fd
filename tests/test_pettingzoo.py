"""PettingZoo games (real `pettingzoo` classic envs) through `from_pettingzoo`: an AEC game played to the end with
exact ledgers and PettingZoo's own rewards, an illegal (masked) move ending the game with the penalty, and a
Parallel game with simultaneous moves."""

from __future__ import annotations

import re

import numpy as np
import pytest

from slime_env import ScriptedPolicy, get_renderer, run_multi_agent_episode
from slime_env.integrations.pettingzoo import from_pettingzoo

pytest.importorskip("pettingzoo")
from pettingzoo.classic import rps_v2, tictactoe_v3  # noqa: E402


def legal_actions(agent, observation) -> str:
    return f"Legal actions: {' '.join(map(str, np.flatnonzero(observation['action_mask'])))}. Your move?"


def first_legal(context: str) -> str:
    return f"<move>{re.findall(r'Legal actions: ([0-9 ]+)', context)[-1].split()[0]}</move>"


def play(runner, env, policy, tok, **kw):
    return runner.run(run_multi_agent_episode(env, policy, "play", renderer=get_renderer(tok, strict=True), **kw))


def test_an_aec_game_runs_to_its_end_with_pettingzoos_rewards(runner, smollm2_tok):
    env = from_pettingzoo(tictactoe_v3.env(), render=legal_actions)
    trajs = play(runner, env, ScriptedPolicy(smollm2_tok, first_legal), smollm2_tok, seed=0)
    assert set(trajs) == {"player_1", "player_2"}
    assert sorted(t.reward for t in trajs.values()) == [-1.0, 1.0]  # first-legal play: someone wins
    for t in trajs.values():
        t.check()
        assert t.status == "completed" and not t.metadata.get("history_rewrites")
        assert all("<move>" in m.content for m in t.messages if m.role == "assistant")
    # each agent saw the other's moves as inserted tokens
    inserted = smollm2_tok.decode([i for i, m in zip(trajs["player_2"].response_ids, trajs["player_2"].loss_mask)
                                   if not m])
    assert "player_1 played" in inserted


def test_a_masked_move_ends_the_game_with_the_penalty(runner, smollm2_tok):
    env = from_pettingzoo(tictactoe_v3.env(), render=legal_actions, illegal_reward=-2.0)
    trajs = play(runner, env, ScriptedPolicy(smollm2_tok, ["<move>0</move>"]), smollm2_tok)
    assert trajs["player_2"].reward == -2.0 and trajs["player_1"].reward == 0.0  # player_2 repeats cell 0
    assert "action 0 is not allowed now" in trajs["player_1"].messages[-1].content
    nonsense = play(runner, from_pettingzoo(tictactoe_v3.env(), render=legal_actions),
                    ScriptedPolicy(smollm2_tok, ["no idea"]), smollm2_tok)
    assert nonsense["player_1"].reward == -1.0 and "no action found" in nonsense["player_1"].messages[-1].content


def test_a_parallel_game_moves_simultaneously(runner, smollm2_tok):
    env = from_pettingzoo(rps_v2.parallel_env(max_cycles=3), render=lambda agent, obs: f"Last seen: {int(obs)}.")
    rock = ScriptedPolicy(smollm2_tok, ["<move>0</move>"])
    paper = ScriptedPolicy(smollm2_tok, ["<move>1</move>"])
    trajs = play(runner, env, {"player_0": rock, "player_1": paper}, smollm2_tok)
    assert trajs["player_1"].turn_rewards == [1.0, 1.0, 1.0] and trajs["player_0"].reward == -3.0
    for t in trajs.values():
        t.check()
        # rps ends by its time limit: PettingZoo says truncation, and so does the trajectory
        assert t.num_turns == 3 and t.status == "truncated", t.status


def test_simultaneous_illegal_moves_penalise_every_offender(runner, smollm2_tok):
    env = from_pettingzoo(rps_v2.parallel_env(max_cycles=3), render=lambda agent, obs: f"Last seen: {int(obs)}.")
    trajs = play(runner, env, ScriptedPolicy(smollm2_tok, ["junk"]), smollm2_tok)
    assert {a: t.reward for a, t in trajs.items()} == {"player_0": -1.0, "player_1": -1.0}
    assert all("Illegal move by player_0" in t.messages[-1].content and "Illegal move by player_1"
               in t.messages[-1].content for t in trajs.values())
    one = play(runner, from_pettingzoo(rps_v2.parallel_env(max_cycles=3), render=lambda a, o: "Move?"),
               {"player_0": ScriptedPolicy(smollm2_tok, ["<move>0</move>"]),
                "player_1": ScriptedPolicy(smollm2_tok, ["junk"])}, smollm2_tok)
    assert {a: t.reward for a, t in one.items()} == {"player_0": 0.0, "player_1": -1.0}


def test_anything_else_is_refused_by_name():
    with pytest.raises(TypeError, match="neither a PettingZoo AEC nor a Parallel env"):
        from_pettingzoo(object(), render=str)


def test_every_built_in_multi_agent_game_passes_pettingzoos_api_test_through_to_pettingzoo():
    from pettingzoo.test import api_test

    from slime_env import make, registry_ids, spec
    from slime_env.integrations.pettingzoo_export import to_pettingzoo

    games = [i for i in registry_ids() if spec(i).multi_agent]
    assert {"TicTacToe-v0", "RockPaperScissors-v0", "Taboo-v0", "SplitItems-v0"} <= set(games)
    for env_id in games:
        env = to_pettingzoo(make(env_id))
        try:
            api_test(env, num_cycles=40, verbose_progress=False)
        finally:
            env.close()


def test_a_game_played_through_the_aec_view_keeps_the_envs_rewards_and_shows_each_agent_its_moves():
    """Rock-paper-scissors (simultaneous in slime_env) through PettingZoo's AEC loop: the two players act one after
    the other, the env steps once both chose, and the rewards accumulate as the env gave them."""
    from slime_env import make
    from slime_env.integrations.pettingzoo_export import to_pettingzoo

    env = to_pettingzoo(make("RockPaperScissors-v0", rounds=3))
    env.reset(seed=0)
    plays = {"player_0": "<move>paper</move>", "player_1": "<move>rock</move>"}
    totals = {a: 0.0 for a in env.possible_agents}
    seen = []
    for agent in env.agent_iter(max_iter=50):
        obs, reward, terminated, truncated, _ = env.last()
        totals[agent] += reward
        seen.append((agent, str(obs)))
        env.step(None if terminated or truncated else plays[agent])
    env.close()
    assert totals == {"player_0": 3.0, "player_1": -3.0}
    assert seen[0] == ("player_0", seen[0][1]) and "Round 1. Your move." in seen[0][1]
    assert any("your opponent played rock" in o for a, o in seen if a == "player_0")


def test_chess_moves_are_described_in_the_games_own_notation(runner, smollm2_tok):
    """PettingZoo's chess action indices (e.g. 3292) mean nothing to a model: the move line is SAN ("a3"), computed
    from the position before the move."""
    pytest.importorskip("chess")
    from pettingzoo.classic import chess_v6

    env = from_pettingzoo(chess_v6.env(), render=legal_actions)
    trajs = play(runner, env, ScriptedPolicy(smollm2_tok, first_legal), smollm2_tok, seed=0, max_turns=2)
    inserted = smollm2_tok.decode([i for i, m in zip(trajs["player_1"].response_ids, trajs["player_1"].loss_mask)
                                   if not m])
    san = r"(?:[KQRBN]?[a-h]?[1-8]?x?[a-h][1-8](?:=[QRBN])?|O-O(?:-O)?)[+#]?"
    assert re.search(rf"player_0 played {san}\.", inserted) and not re.search(r"played \d+\.", inserted), inserted
