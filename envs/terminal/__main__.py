"""`python -m slime_env.envs.terminal --out DIR --n N [--seed S] [--split train|test] [--kinds train|heldout|all|a,b]`:
write N generated terminal tasks as Harbor task folders under DIR."""

from __future__ import annotations

import argparse

from slime_env.envs.terminal.tasks import DEFAULT_IMAGE, instances, write_task


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m slime_env.envs.terminal", description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", choices=["train", "test"], default=None)
    ap.add_argument("--kinds", default="train", help="train | heldout | all | a comma-separated list")
    ap.add_argument("--image", default=DEFAULT_IMAGE)
    a = ap.parse_args()
    kinds = a.kinds if a.kinds in ("train", "heldout", "all") else a.kinds.split(",")
    pairs = instances(a.n, a.seed, a.split, kinds)
    for kind, seed in pairs:
        write_task(a.out, kind, seed, image=a.image)
    print(f"wrote {len(pairs)} task folders to {a.out}")


if __name__ == "__main__":
    main()
