"""Rank functions for the multi-process tests (spawned ranks import them by module name)."""
import os

import torch
import torch.distributed as dist


def all_reduce_sum(rank: int, world_size: int, base: float) -> tuple[float, int]:
    t = torch.tensor([base + rank])
    dist.all_reduce(t)
    return float(t), os.getpid()


def raise_on_rank1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.barrier()
    return rank


def exit_on_rank0(rank: int, world_size: int) -> None:
    if rank == 0:
        os._exit(7)
    dist.barrier()


def hang(rank: int, world_size: int) -> None:
    import time
    time.sleep(600)


def dtensor_mlp(rank: int, world_size: int, mlp, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One Llama MLP sharded two ways on the same ranks: torch's own tensor parallelism (DTensor, ColwiseParallel
    gate/up, RowwiseParallel down) and ours (`tensor.tp_mlp_forward`: the shards + one all_reduce)."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from llmso_lab.parallel.tensor import TensorParallelGroup, tp_mlp_forward

    with torch.no_grad():
        ours = tp_mlp_forward(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight,
                              TensorParallelGroup(rank, world_size))
    mesh = init_device_mesh("cpu", (world_size,))
    peer = parallelize_module(copy.deepcopy(mlp), mesh, {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                                                        "down_proj": RowwiseParallel()})
    with torch.no_grad():
        theirs = peer(x)
    if hasattr(theirs, "wait"):   # an AsyncCollectiveTensor: the RowwiseParallel all-reduce may still be in flight
        theirs = theirs.wait()
    return ours.detach(), torch.as_tensor(theirs).detach().clone()
