"""Per-turn framework overhead of the token ledger vs re-rendering the whole conversation.

One turn of framework work = parse the assistant turn + env step + render the observation
(bridge) + ledger update + decode the turn's text for the env. Measured at 1, 8, 32 and 128 turns
of history, beside the naive approach other frameworks use (apply the chat template to the whole
conversation and re-tokenize it every turn), in the same run and process.
"Excl. tokenize" subtracts the time the tokenizer spends on the new observation's text (the same
string, encoded alone), which no approach can avoid.

Strict mode (every id checked against a full render of the chat template) is measured apart, at 32, 128 and 512
turns: one turn's checks with the prefix earlier turns proved (`VerifiedPrefix`: only the new turn is encoded),
beside re-encoding the whole render (what strict mode did before), in the same run.

    python bench/ledger.py [--family smollm2|qwen2.5|llama3.1] [--iters 300]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from slime_env import Action, Env, Message, get_parser, get_renderer
from slime_env import offline_tokenizers as ot
from slime_env.ledger import TokenLedger
from slime_env.renderers import VerifiedPrefix

REPLY = ('Let me look that up.\n<tool_call>{"name": "search", "arguments": {"query": "population of the '
         'largest city in France, turn %d"}}</tool_call>')
OBSERVATION = ("Doc 1(Title: Paris) Paris is the capital and most populous city of France, with an estimated "
               "population of 2,102,650 residents in January 2023 (result %d).")


class EchoEnv(Env):
    parser = "hermes"

    async def reset(self, *, seed=None, options=None):
        return [Message("user", "How many people live in Paris?")], {}

    async def step(self, action: Action):
        n = len(action.tool_calls)
        return [Message("tool", OBSERVATION % self.counter)], 0.0, False, False, {"calls": n}

    counter = 0


def _tokenizer(family: str):
    return {"smollm2": ot.smollm2, "qwen2.5": lambda: ot.qwen("2.5"), "llama3.1": ot.llama3}[family]()


def _step_sync(env: Env, action: Action):
    """Drive the env's coroutine to completion without an event loop hop (it never awaits I/O)."""
    coro = env.step(action)
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("bench env awaited something")


def measure(renderer, history_turns: int, iters: int) -> dict[str, float]:
    env, parse = EchoEnv(), get_parser("hermes")
    prompt = asyncio.run(env.reset())[0]
    ledger = TokenLedger(renderer.render_prompt(prompt))
    messages = list(prompt)
    eot = renderer.end_of_turn_id
    # Build the history with the same code path (untimed).
    for k in range(history_turns):
        gen = renderer.encode(REPLY % k) + [eot]
        ledger.add_generated(gen, [-0.1] * len(gen), k)
        messages.append(Message("assistant", REPLY % k))
        EchoEnv.counter += 1
        obs = [Message("tool", OBSERVATION % EchoEnv.counter)]
        ledger.add_inserted(renderer.bridge(gen, obs, messages), k)
        messages.extend(obs)
    gen = renderer.encode(REPLY % history_turns) + [eot]
    logprobs = [-0.1] * len(gen)
    sizes = (len(ledger.response_ids), len(ledger.loss_mask), len(ledger.rollout_logprobs), len(ledger.ids),
             len(ledger.spans))

    ours, tokenize, naive = [], [], []
    # Each approach runs in its own loop, so one does not evict the other's data from the CPU caches.
    for i in range(iters):
        EchoEnv.counter += 1  # a new observation every time: no bridge cache hits
        t0 = time.perf_counter()
        ledger.add_generated(gen, logprobs, history_turns)
        text = renderer.assistant_text(gen)
        parsed = parse(text)
        action = Action(text=text, token_ids=tuple(gen), tool_calls=parsed.tool_calls,
                        parse_errors=parsed.errors)
        obs, *_ = _step_sync(env, action)
        ledger.add_inserted(renderer.bridge(gen, obs, messages), history_turns)
        ours.append(time.perf_counter() - t0)
        # roll the ledger back to `history_turns` (untimed)
        for lst, n in zip((ledger.response_ids, ledger.loss_mask, ledger.rollout_logprobs, ledger.ids, ledger.spans),
                          sizes):
            del lst[n:]
    text = renderer.assistant_text(gen)
    for i in range(iters):
        EchoEnv.counter += 1
        obs = [Message("tool", OBSERVATION % EchoEnv.counter)]
        t0 = time.perf_counter()
        renderer.encode(obs[0].content)  # the unavoidable part: tokenizing the observation text itself
        tokenize.append(time.perf_counter() - t0)
    for i in range(max(20, iters // 5)):
        EchoEnv.counter += 1
        full = messages + [Message("assistant", text), Message("tool", OBSERVATION % EchoEnv.counter)]
        t0 = time.perf_counter()  # naive: re-render and re-tokenize the whole conversation
        renderer.encode(renderer.render_text(full, add_generation_prompt=True))
        naive.append(time.perf_counter() - t0)
    med = lambda xs: statistics.median(xs) * 1e6  # noqa: E731
    return {"ours_us": med(ours), "tokenize_us": med(tokenize), "naive_us": med(naive),
            "history_tokens": sizes[3]}


def measure_strict(renderer, history_turns: int, iters: int) -> dict[str, float]:
    """One turn's strict checks after `history_turns` turns: with the proved prefix (as the runner keeps it) and
    by encoding the whole render; both must agree (None: the ledger equals the render)."""
    messages = [Message("user", "How many people live in Paris?")]
    ids = renderer.render_prompt(messages)
    eot = renderer.end_of_turn_id
    verified = VerifiedPrefix()
    for k in range(history_turns + 1):
        gen = renderer.encode(REPLY % k) + [eot]
        messages.append(Message("assistant", REPLY % k))
        obs = [Message("tool", OBSERVATION % k)]
        bridge = renderer.bridge(gen, obs, messages)
        ids = ids + gen + bridge
        history, messages = list(messages), messages + obs
        if k < history_turns:  # the earlier turns' checks (untimed) leave the state the last turn starts from
            renderer.check_full(messages, ids, verified=verified)
    incremental, whole = [], []
    for _ in range(iters):
        v = VerifiedPrefix(verified.text, verified.ids)
        t0 = time.perf_counter()  # agreement proves the bridge too (the runner checks it apart only on a note)
        assert renderer.check_full(messages, ids, verified=v) is None
        incremental.append(time.perf_counter() - t0)
    for _ in range(max(5, iters // 10)):
        t0 = time.perf_counter()
        renderer.check_bridge(history, gen, obs, bridge)
        assert renderer.check_full(messages, ids) is None
        whole.append(time.perf_counter() - t0)
    med = lambda xs: statistics.median(xs) * 1e6  # noqa: E731
    return {"incremental_us": med(incremental), "whole_us": med(whole), "tokens": len(ids)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="smollm2", choices=["smollm2", "qwen2.5", "llama3.1"])
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    renderer = get_renderer(_tokenizer(args.family))
    print(f"bench/ledger.py  family={args.family}  renderer={renderer.family}  iters={args.iters}  "
          "(median per turn, microseconds)")
    print(f"{'history turns':>13} {'tokens':>7} {'ours':>9} {'tokenize obs':>13} {'ours excl.':>11} "
          f"{'naive':>10} {'naive/ours':>11}")
    for h in (1, 8, 32, 128):
        r = measure(renderer, h, args.iters)
        excl = r["ours_us"] - r["tokenize_us"]
        print(f"{h:>13} {r['history_tokens']:>7} {r['ours_us']:>9.1f} {r['tokenize_us']:>13.1f} {excl:>11.1f} "
              f"{r['naive_us']:>10.1f} {r['naive_us'] / r['ours_us']:>10.1f}x")
    print("\nstrict mode, one turn's checks (median microseconds)")
    print(f"{'history turns':>13} {'tokens':>7} {'proved prefix':>14} {'whole render':>13} {'whole/prefix':>13}")
    for h in (32, 128, 512):
        r = measure_strict(renderer, h, max(20, args.iters // 3))
        print(f"{h:>13} {r['tokens']:>7} {r['incremental_us']:>14.1f} {r['whole_us']:>13.1f} "
              f"{r['whole_us'] / r['incremental_us']:>12.1f}x")


if __name__ == "__main__":
    main()
