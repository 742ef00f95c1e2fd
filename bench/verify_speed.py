"""Math verification throughput: our MathVerifier beside math-verify called directly, on the same pairs.

Workload: a mixed set of (response, gold) pairs — integers, fractions (LaTeX, slash and decimal),
LaTeX expressions (polynomials factored vs expanded; radicals with pi) and sets (permuted) — about
half of them correct.
Two shapes, each measured cold (fresh verifier, empty caches):
- `distinct`: every pair once;
- `grpo x8`: every gold with 8 sampled responses (what a GRPO group gives the reward function),
  some repeating an answer.
Baseline: `math_verify.verify(parse(gold), parse(response))` in one process, one pair after another
(math-verify's own defaults). Ours: `MathVerifier(workers=2)` with all pairs in flight at once.
Agreement = share of pairs on which our verdict equals math-verify's. Usage: python bench/verify_speed.py [--n 400]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import time

from slime_env.envs.math.verifier import MathVerifier  # noqa: E402


def integers(rng: random.Random) -> tuple[str, str]:
    gold = rng.randint(-5000, 100000)
    answer = gold if rng.random() < 0.5 else gold + rng.choice([-10, -1, 1, 2, 100])
    return f"Adding it all up gives {answer}. So the answer is \\boxed{{{answer}}}.", str(gold)


def fractions(rng: random.Random) -> tuple[str, str]:
    p, q = rng.randint(1, 97), rng.randint(2, 97)
    k = rng.randint(2, 9)
    form = rng.choice(["latex", "slash", "decimal"])
    if rng.random() < 0.5:
        answer = {"latex": f"\\frac{{{p * k}}}{{{q * k}}}", "slash": f"{p * k}/{q * k}",
                  "decimal": f"{p / q:.6f}"}[form]
    else:
        answer = {"latex": f"\\frac{{{p + 1}}}{{{q}}}", "slash": f"{p}/{q + 1}", "decimal": f"{(p + 1) / q:.6f}"}[form]
    return f"Simplifying, \\boxed{{{answer}}}", f"\\frac{{{p}}}{{{q}}}"


def expressions(rng: random.Random) -> tuple[str, str]:
    """Half polynomials (factored vs expanded), half radicals and pi (those always go to math-verify)."""
    a, b = rng.randint(1, 30), rng.randint(1, 30)
    if rng.random() < 0.5:
        gold = f"x^2+{a + b}x+{a * b}"
        c = b if rng.random() < 0.5 else b + rng.randint(1, 5)
        return f"Factoring: \\boxed{{(x+{a})(x+{c})}}", gold
    n = rng.choice([2, 3, 5, 6, 7, 10, 11])
    inner = a * a * n if rng.random() < 0.5 else a * a * n + 1
    return (f"So the length is \\boxed{{\\frac{{\\sqrt{{{inner}}}\\pi}}{{{b}}}}}",
            f"\\frac{{{a}\\sqrt{{{n}}}\\pi}}{{{b}}}")


def sets(rng: random.Random) -> tuple[str, str]:
    items = rng.sample(range(-50, 200), 4)
    shown = items[:]
    rng.shuffle(shown)
    if rng.random() < 0.5:
        shown[0] += 1000
    return f"The solutions are \\boxed{{\\{{{', '.join(map(str, shown))}\\}}}}", f"\\{{{', '.join(map(str, items))}\\}}"


KINDS = {"integers": integers, "fractions": fractions, "expressions": expressions, "sets": sets}


def workload(n: int, seed: int, group: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    pairs = []
    for i in range(n):
        make = list(KINDS.values())[i % len(KINDS)]
        if group == 1:
            pairs.append(make(rng))
        else:
            state = rng.random()
            golds = []
            for _ in range(group):
                sub = random.Random(state)  # same gold for the whole group, answers vary
                response, gold = make(sub)
                answer_rng = random.Random(rng.random())
                if answer_rng.random() < 0.5:
                    response, _ = make(random.Random(state))  # repeats the group's first answer form
                golds.append((response + " " * answer_rng.randint(0, 1), gold))
            pairs.extend(golds)
    return pairs


def baseline(pairs: list[tuple[str, str]]) -> tuple[list[bool], float]:
    from math_verify import parse, verify

    t0 = time.perf_counter()
    verdicts = [bool(verify(parse(f"${gold}$"), parse(response))) for response, gold in pairs]
    return verdicts, time.perf_counter() - t0


async def ours(pairs: list[tuple[str, str]], workers: int) -> tuple[list[bool], float, dict]:
    verifier = MathVerifier(workers=workers)
    await verifier.warm_up()  # worker start-up (imports) is not per verification
    t0 = time.perf_counter()
    verdicts = await asyncio.gather(*(verifier.verify(r, g) for r, g in pairs))
    took = time.perf_counter() - t0
    stats = dict(verifier.stats)
    verifier.close()
    return [v.correct for v in verdicts], took, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=400, help="pairs (distinct) / groups (grpo) per run")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    print(f"{os.cpu_count()} cores, {args.workers} verifier workers\n")
    print(f"{'workload':24s} {'pairs':>6s} {'math-verify/s':>14s} {'ours/s':>8s} {'speed-up':>9s} "
          f"{'agreement':>10s}  ours by method")
    for name, group, kinds in [("integers", 1, ["integers"]), ("mixed distinct", 1, list(KINDS)),
                               ("mixed grpo x8", 8, list(KINDS))]:
        if kinds == ["integers"]:
            rng = random.Random(1)
            pairs = [integers(rng) for _ in range(args.n * 4)]
        else:
            pairs = workload(args.n if group == 1 else args.n // 4, seed=2, group=group)
        base_v, base_t = baseline(pairs)
        our_v, our_t, stats = asyncio.run(ours(pairs, args.workers))
        agree = sum(a == b for a, b in zip(base_v, our_v)) / len(pairs)
        methods = ", ".join(f"{k}={v}" for k, v in sorted(stats.items()))
        print(f"{name:24s} {len(pairs):6d} {len(pairs) / base_t:14.0f} {len(pairs) / our_t:8.0f} "
              f"{base_t / our_t:8.1f}x {agree:10.1%}  {methods}")


if __name__ == "__main__":
    main()
