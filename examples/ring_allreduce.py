"""A Ring of peer jobs forming a torch.distributed group and all-reducing a tensor.

    python examples/ring_allreduce.py [--size 4]

Each member learns its rank and the rendezvous address from the environment
that the Ring sets, so ``init_process_group("gloo")`` needs no arguments.
"""

from __future__ import annotations

import argparse

import fiber_core as mp


def allreduce(rank: int, size: int, results) -> None:  # noqa: ANN001
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=size)
    tensor = torch.full((4,), float(rank + 1))
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    results.put((rank, tensor.tolist()))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=4)
    args = parser.parse_args()
    results = mp.Queue()
    ring = mp.Ring(args.size, lambda rank, size: allreduce(rank, size, results))
    ring.run()
    for rank, tensor in sorted(results.get(timeout=30) for _ in range(args.size)):
        print(f"rank {rank}: {tensor}")


if __name__ == "__main__":
    main()
