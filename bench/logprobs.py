"""Token log-probs from logits: the trainer's `token_logprobs` (logit minus logsumexp, a slice of positions at a
time; `slime_env.trainers.algorithms`) beside the log_softmax + gather it replaced, in one run: the largest
log-prob and gradient differences, the time of forward + backward, and the peak memory above the logits.

    python bench/logprobs.py                 # on a GPU if there is one (bf16, Qwen's 151,936-token vocabulary)
    python bench/logprobs.py --cases 4x700x49152   # a CPU step of SmolLM2's shape (float32)
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from slime_env.trainers.algorithms import token_logprobs


def log_softmax_gather(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The replaced path: a float32 [B, T, V] log-softmax kept for the backward."""
    return torch.gather(torch.log_softmax(logits.float(), -1), -1, tokens.unsqueeze(-1)).squeeze(-1)


def _peak_gb(device: torch.device, base: float) -> float:
    if device.type == "cuda":
        return (torch.cuda.max_memory_allocated() - base) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20 - base  # KB -> GB; a CPU peak never resets


def run(B: int, T: int, V: int, dtype: torch.dtype, device: torch.device, reps: int) -> None:
    torch.manual_seed(0)
    full = (torch.randn(B, T + 1, V, device=device, dtype=dtype) * 2).requires_grad_()  # logits[:, :-1], as trained
    tokens, weights = torch.randint(0, V, (B, T), device=device), torch.randn(B, T, device=device)
    out = {}
    # the new path first on a CPU: ru_maxrss only grows, so the old path's peak there is a bound for both
    for name, fn in (("token_logprobs", token_logprobs), ("log_softmax+gather", log_softmax_gather)):
        for _ in range(reps):
            full.grad = None
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            else:
                base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            t0 = time.perf_counter()
            lp = fn(full[:, :-1], tokens)
            (lp * weights).sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        out[name] = (lp.detach(), full.grad.clone(), seconds, _peak_gb(device, base))
    (a, ga, ta, ma), (b, gb, tb, mb) = out["log_softmax+gather"], out["token_logprobs"]
    print(f"{B}x{T}x{V} {str(dtype).removeprefix('torch.')} on {device.type}: max |log-prob diff| "
          f"{(a - b).abs().max().item():.1e}, max |grad diff| {(ga.float() - gb.float()).abs().max().item():.1e}; "
          f"log_softmax+gather {ta * 1e3:.1f} ms, {ma:.2f} GB; token_logprobs {tb * 1e3:.1f} ms, {mb:.2f} GB",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=None, help="BxTxV,... (default: GPU 4x4096x151936,1x32768x151936; CPU "
                    "4x700x49152)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cases = args.cases or ("4x4096x151936,1x32768x151936" if device.type == "cuda" else "4x700x49152")
    for case in cases.split(","):
        B, T, V = (int(x) for x in case.split("x"))
        run(B, T, V, dtype, device, args.reps)
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
