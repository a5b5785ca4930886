"""Reference implementations for the grader's protocol tests (a process-spawning function and a class)."""
import multiprocessing as mp


def _rank(rank, world, value, port, out):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    t = torch.tensor([value])
    dist.all_reduce(t)
    if rank == 0:
        out.put(float(t.item()))
    dist.destroy_process_group()


def allreduce_sum(values):
    """Sum `values` with a gloo all_reduce across len(values) processes."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, len(values), v, port, out)) for r, v in enumerate(values)]
    for p in procs:
        p.start()
    result = out.get(timeout=60)
    for p in procs:
        p.join()
    return result


# --- class ---
class Counter:
    def __init__(self, start):
        self.total = start

    def add(self, x):
        if self.total + x < 0:
            raise ValueError("counter would go negative")
        self.total += x

    def value(self):
        return self.total
