"""Two gloo ranks through ``lmstack.parallel.init_distributed(timeout_s=T)``; rank 1 stalls (alive,
asleep) instead of joining the barrier. Rank 0 prints how long it waited and what it raised.

    python reliability_stall_driver.py RANK PORT TIMEOUT_S STALL_S
"""

import os
import sys
import time

rank, port, timeout_s, stall_s = (
    int(sys.argv[1]),
    sys.argv[2],
    float(sys.argv[3]),
    float(sys.argv[4]),
)
os.environ.update(
    RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_RANK=str(rank)
)

import torch.distributed as dist  # noqa: E402

from lmstack.parallel import init_distributed  # noqa: E402

init_distributed("gloo", timeout_s=timeout_s)
if rank == 1:
    time.sleep(stall_s)
    os._exit(0)
t0 = time.monotonic()
try:
    dist.barrier()
    print(f"no error after {time.monotonic() - t0:.1f}s", flush=True)
except Exception as e:  # gloo reports the timeout as a RuntimeError (DistBackendError)
    print(f"{type(e).__name__} after {time.monotonic() - t0:.1f}s: {str(e)[:200]}", flush=True)
os._exit(0)
