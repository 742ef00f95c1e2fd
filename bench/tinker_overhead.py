"""Per-call overhead of the Tinker API: `forward_backward` + `optim_step` through the `tinker` SDK and
`slime-env serve-tinker` (HTTP on loopback, protobuf, futures and their polling, the adapter's checks), against the
same two calls made on a `TorchTrainer` in-process (`forward_backward` / `optim_step` of
`slime_env.trainers.split_step`: the same base model, LoRA, loss and Adam as the server's training client). The
difference is what the API costs per step.

    .venv/bin/python -P bench/tinker_overhead.py [--steps 20] [--batch 4] [--tokens 64] [--hidden 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TINKER_API_KEY", "tml-local")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

MODEL = "Qwen/Qwen3-8B"


def main(steps: int, batch: int, tokens: int, hidden: int) -> dict[str, float]:
    import numpy as np
    import tinker
    import torch
    from tinker_support import ServerThread

    from slime_env.trainers.split_step import AdamParams, Datum
    from slime_env.trainers.tinker import TinkerBackend
    from slime_env.trainers.tinker.backend import ATTN, LORA_ALPHA, MLP, shared_base
    from slime_env.trainers.tinker.losses import loss_for
    from slime_env.trainers.tinker.models import load_tokenizer, random_model
    from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig

    torch.set_num_threads(1)
    tok = load_tokenizer("qwen3")
    rng = np.random.default_rng(0)
    seqs = [torch.from_numpy(rng.integers(0, 150000, tokens + 1)) for _ in range(batch)]
    adam = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
    with tempfile.TemporaryDirectory() as tmp:
        backend = TinkerBackend(MODEL, random_model(tok, hidden=hidden), tok, tmp)
        # direct: a TorchTrainer in-process, as the server builds one per training client
        lora = {"rank": 8, "alpha": LORA_ALPHA, "target_modules": list(ATTN + MLP)}
        direct_trainer = TorchTrainer(shared_base(backend.base), TrainerConfig(lora=lora), pad_id=backend.pad_id)
        data = [Datum(s[:-1], s[1:], {"weights": torch.ones(tokens)}) for s in seqs]
        loss = loss_for("cross_entropy", {})[0]
        with ServerThread(backend) as url:
            trainer = tinker.ServiceClient(base_url=url).create_lora_training_client(base_model=MODEL, rank=8).result()
            datums = [tinker.Datum(model_input=tinker.ModelInput.from_ints(s[:-1].tolist()),
                                   loss_fn_inputs={"target_tokens": s[1:].tolist(), "weights": [1.0] * tokens})
                      for s in seqs]
            direct, api = [], []
            for i in range(steps + 2):  # interleaved, so load on a shared machine hits both alike
                t0 = time.perf_counter()
                direct_trainer.forward_backward(data, loss)
                direct_trainer.optim_step(AdamParams(**adam))
                t1 = time.perf_counter()
                fb = trainer.forward_backward(datums, "cross_entropy")
                op = trainer.optim_step(tinker.AdamParams(**adam))
                fb.result(), op.result()
                if i >= 2:
                    direct.append(t1 - t0)
                    api.append(time.perf_counter() - t1)
    d, a = statistics.median(direct), statistics.median(api)
    return {"direct_ms": d * 1e3, "api_ms": a * 1e3, "overhead_ms": (a - d) * 1e3, "overhead_pct": 100 * (a - d) / d}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=64)
    args = ap.parse_args()
    r = main(args.steps, args.batch, args.tokens, args.hidden)
    print(f"forward_backward + optim_step, batch {args.batch} x {args.tokens} tokens, hidden {args.hidden}, "
          f"median of {args.steps}:")
    print(f"  direct (TorchTrainer in-process):  {r['direct_ms']:8.1f} ms")
    print(f"  tinker SDK -> serve-tinker (HTTP): {r['api_ms']:8.1f} ms")
    print(f"  overhead per step:                 {r['overhead_ms']:8.1f} ms ({r['overhead_pct']:.0f}%)")
