"""Times torch.distributed initialisation with NCCL (world size 1 per GPU here) and a first all-reduce.

Usage: ``python loadtest/nccl_init.py`` on a machine with CUDA.
"""

from __future__ import annotations

import json
import os
import time


def main() -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    started = time.perf_counter()
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    initialised = time.perf_counter()
    tensor = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(tensor)
    torch.cuda.synchronize()
    first = time.perf_counter()
    dist.all_reduce(tensor)
    torch.cuda.synchronize()
    second = time.perf_counter()
    dist.destroy_process_group()
    print(
        json.dumps(
            {
                "init_process_group_s": round(initialised - started, 3),
                "first_all_reduce_s": round(first - initialised, 3),
                "second_all_reduce_ms": round((second - first) * 1000, 3),
                "nccl_version": ".".join(map(str, torch.cuda.nccl.version())),
            }
        )
    )


if __name__ == "__main__":
    main()
