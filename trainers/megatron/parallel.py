"""torch.distributed and megatron-core's parallel state, set up once per process.

Under `torchrun` (RANK / WORLD_SIZE / LOCAL_RANK set) this joins the job (NCCL on CUDA); run as a plain
process it starts a one-process group on a free loopback port (gloo on CPU), so the same trainer code
runs in a notebook, in CI and on a GPU node.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def init_parallel(tp: int = 1, *, ep: int = 1, cp: int = 1, pp: int = 1, seed: int = 0) -> dict[str, int]:
    """Initialise (once) the process group and megatron's TP / CP / PP / DP / EP groups; returns rank, world and the
    sizes (`dp` counts data-parallel replicas, CP ranks not included).

    A TP x CP x PP or EP x PP size that does not divide the world size is refused here with the sizes named. Experts
    are never split over TP (expert TP = 1): EP ranks hold whole experts, the attention stays TP x CP x DP.
    """
    from megatron.core import parallel_state as ps
    from slime_env.trainers.distributed import init_process_group

    _, world = init_process_group()
    for what, n in (("tensor", tp), ("context", cp), ("pipeline", pp), ("tensor x context x pipeline", tp * cp * pp),
                    ("expert x pipeline", ep * pp)):
        if world % n:
            raise ValueError(f"{what}-parallel size {n} does not divide the world size {world}")
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size(),
                ps.get_context_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if have != (tp, ep, cp, pp):
            raise ValueError(f"megatron is already initialised with TP={have[0]}, EP={have[1]}, CP={have[2]}, "
                             f"PP={have[3]}; asked for TP={tp}, EP={ep}, CP={cp}, PP={pp}")
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                     pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=1)
    from slime_env.trainers.megatron import cpu_compat

    cpu_compat.install()
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    return {"rank": dist.get_rank(), "world": world, "tp": tp, "dp": ps.get_data_parallel_world_size(),
            "tp_rank": ps.get_tensor_model_parallel_rank(), "dp_rank": ps.get_data_parallel_rank(), "ep": ep,
            "ep_rank": ps.get_expert_model_parallel_rank(), "cp": cp, "cp_rank": ps.get_context_parallel_rank(),
            "pp": pp, "pp_rank": ps.get_pipeline_model_parallel_rank()}
