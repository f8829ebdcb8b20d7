"""`trainer.train`, except that with TFMW_TEST_TRAIN_FAULT="<rank>:<step>" that rank SIGKILLs itself right
after saving the checkpoint of that step: a worker lost at a checkpointed step, at a step the test knows."""

import os
import signal
import sys

from trainer import checkpoint, train

FAULT = os.environ.get("TFMW_TEST_TRAIN_FAULT", "")

if FAULT:
    fault_rank, fault_step = (int(part) for part in FAULT.split(":"))
    save = checkpoint.CheckpointStore.save

    def save_then_die(self, step: int) -> None:
        save(self, step)
        if self.rank == fault_rank and step == fault_step:
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint.CheckpointStore.save = save_then_die

if __name__ == "__main__":
    sys.exit(train.main())
