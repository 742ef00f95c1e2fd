"""TextArena's tic-tac-toe (the real `textarena` package, offline) through `from_textarena`: players' chats hold what
TextArena showed each of them, replies go to TextArena verbatim, its rewards end the game; ledgers exact."""

from __future__ import annotations

import re

import pytest

from slime_env import ScriptedPolicy, get_renderer, run_multi_agent_episode
from slime_env.integrations.textarena import from_textarena

ta = pytest.importorskip("textarena")


def first_available(context: str) -> str:
    moves = re.findall(r"Available Moves: ([^\n]+)", context)[-1]
    return re.findall(r"\[\d\]", moves)[0]


def test_textarena_tictactoe_is_played_to_the_end(runner, smollm2_tok):
    env = from_textarena(ta.make(env_id="TicTacToe-v0"), num_players=2)
    trajs = runner.run(run_multi_agent_episode(env, ScriptedPolicy(smollm2_tok, first_available), "play",
                                               renderer=get_renderer(smollm2_tok, strict=True), seed=0))
    assert set(trajs) == {"player_0", "player_1"}
    assert sorted(t.reward for t in trajs.values()) == [-1.0, 1.0]
    for t in trajs.values():
        t.check()
        assert t.status == "completed" and not t.metadata.get("history_rewrites")
    p1_shown = smollm2_tok.decode(trajs["player_1"].prompt_ids + [
        i for i, m in zip(trajs["player_1"].response_ids, trajs["player_1"].loss_mask) if not m])
    assert p1_shown.count("You are Player 1") == 1  # each observation holds only what is new to the player
    assert "[Player 0] [0]" in p1_shown


def test_invalid_moves_are_textarenas_business(runner, smollm2_tok):
    env = from_textarena(ta.make(env_id="TicTacToe-v0"), num_players=2)
    trajs = runner.run(run_multi_agent_episode(env, ScriptedPolicy(smollm2_tok, ["[4]"]), "play",
                                               renderer=get_renderer(smollm2_tok), seed=0, max_turns=6))
    assert all(t.status in ("completed", "truncated") for t in trajs.values())
    p1 = " ".join(m.content for m in trajs["player_1"].messages)
    assert "invalid move" in p1.lower()


def test_train_variants_send_only_what_is_new_and_the_reason_of_an_invalid_move(runner, smollm2_tok):
    """`ConnectFour-v0-train`'s wrapper puts the board last, so its text never extends the previous one: the new
    messages come from TextArena's message list instead — the intro once, and an invalid move's reason."""
    def play(context: str) -> str:
        return "[9]" if context.count("[9]") < 1 else "[3]"  # the first move is out of bounds, then a real one

    env = from_textarena(ta.make(env_id="ConnectFour-v0-train"), num_players=2)
    trajs = runner.run(run_multi_agent_episode(env, ScriptedPolicy(smollm2_tok, play), "play",
                                               renderer=get_renderer(smollm2_tok, strict=True), seed=0, max_turns=4))
    for agent, t in trajs.items():
        t.check()
        shown = smollm2_tok.decode(t.prompt_ids + [i for i, m in zip(t.response_ids, t.loss_mask) if not m])
        assert shown.count(f"You are Player {agent[-1]} in Connect Four") == 1, shown
    p0 = " ".join(m.content for m in trajs["player_0"].messages if m.role == "user")
    assert "Column 9 is out of bounds" in p0  # the reason, not only "(your turn)"
