"""A rank that stops answering ends the job within dist.timeout_s with a clear error, instead of hanging the rest.

2 gloo ranks run pretrain_llama.main() (tiny Llama, UPipe over cp=2) with dist.timeout_s=3; rank 1 stalls for
10 s at the start of step 2. Rank 0, waiting in step 2's first collective, must give up after about 3 s with exit
code 4 and a message naming its rank, the step and the timeout; rank 1, resuming into a job whose peer has left,
must fail the same way rather than hang.
"""

from __future__ import annotations

import time

from tests.dist_helper import run_on_ranks
from tests.train_harness import SMALL, run_main

TIMEOUT_S, STALL_S = 3, 10


def _job(rank, world_size, tmp):
    from megatron_upipe.training import loop

    orig = loop.train_step
    seen = {}

    def train_step(state, data_iterator, *args):
        if state.step + 1 == 2:
            seen["step2_start"] = time.monotonic()
            if rank == 1:
                time.sleep(STALL_S)  # stops answering
        return orig(state, data_iterator, *args)

    loop.train_step = train_step
    code, err = run_main(*SMALL, "train.steps=4", f"dist.timeout_s={TIMEOUT_S}", f"log.metrics_file={tmp}/m.jsonl")
    return code, err, time.monotonic() - seen["step2_start"]


def test_a_stalled_rank_ends_the_job_within_the_timeout(tmp_path):
    (code0, err0, waited0), (code1, err1, _) = run_on_ranks(_job, 2, str(tmp_path))
    assert code0 == 4, err0
    assert f"rank 0, step 2: a collective failed" in err0 and f"dist.timeout_s={TIMEOUT_S}s" in err0, err0
    assert TIMEOUT_S - 0.5 <= waited0 < STALL_S - 2, waited0  # gave up on the timeout, not when rank 1 came back
    assert code1 == 4 and "rank 1, step 2: a collective failed" in err1, err1
