"""Run under torchrun (2 ranks): rank 1 gets a preemption request in the middle of step SIGNAL_AT
of a loop of steps of a given length; each rank writes OUT/rank<R>.json: for each step length,
the step whose end first agreed on it and the seconds from the request to that agreement."""

import json
import signal
import sys
import time
from pathlib import Path

from framework import ProcessContext
from framework.checkpoint import preemption

SIGNAL_AT = 3
out_dir = Path(sys.argv[1])
job = ProcessContext.start(timeout_s=60)
results = {}
for step_s in map(float, sys.argv[2:]):
    preemption._requests = preemption._Requests()  # a fresh process's state, for each case
    agreement = preemption.Agreement(job)
    job.barrier()
    step, asked = 0, None
    while step < 200:
        step += 1
        time.sleep(step_s / 2)
        if step == SIGNAL_AT:
            asked = time.time()
            if job.rank == 1:
                preemption.note_requested(asked, signal.SIGTERM)
        time.sleep(step_s / 2)
        if agreement.poll():
            break
    agreement.drain()
    results[str(step_s)] = {"step": step, "after_s": time.time() - asked}
(out_dir / f"rank{job.rank}.json").write_text(json.dumps(results))
job.close()
