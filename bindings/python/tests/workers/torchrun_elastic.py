"""Elastic restarts under torchrun (--max-restarts): on the first attempt
rank 1 is killed mid-job (SIGKILL, as the OOM killer would); torchrun
restarts every rank, and they meet again through rdist on the agent's
store (env://, keys of their own per restart) and finish."""

import json
import os
import signal

import numpy as np

import rdist

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
with rdist.init(timeout_ms=30000) as comm:
    x = np.full(4, comm.rank + 1, np.float32)
    comm.allreduce(x)
    if attempt == 0 and comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    comm.barrier()  # on the first attempt the others lose rank 1 here
    y = np.full(4, comm.rank + 1, np.float32)
    comm.allreduce(y)
    result = {"rank": comm.rank, "attempt": attempt, "sum": y.tolist()}
with open(os.path.join(os.environ["RESULT_DIR"], f"{result['rank']}.json"), "w") as f:
    f.write(json.dumps(result))
