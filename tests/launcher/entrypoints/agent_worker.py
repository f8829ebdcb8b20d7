"""A worker for the remote agent's tests: prints `env {json}` (the variables named in AGENT_WORKER_SHOW), starts a
child in its process group that ignores SIGTERM, prints `pids <worker> <child>`, then does what AGENT_WORKER_MODE
says:

  stubborn      print `TERM ignored` on each SIGTERM and keep running (only SIGKILL ends it)
  exit:<code>   exit with that code (the child stays behind in the group)
  sigkill       SIGKILL itself
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

mode = os.environ.get("AGENT_WORKER_MODE", "stubborn")
shown = {name: os.environ.get(name) for name in os.environ.get("AGENT_WORKER_SHOW", "").split(",") if name}
print("env " + json.dumps(shown), flush=True)
# The child ignores SIGTERM from its first instruction: an ignored signal stays ignored across fork and exec.
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen(["sleep", "600"])
# Set before the pids are printed: a test may signal as soon as it reads them.
signal.signal(signal.SIGTERM, (lambda *_: print("TERM ignored", flush=True)) if mode == "stubborn" else signal.SIG_DFL)
print(f"pids {os.getpid()} {child.pid}", flush=True)

if mode.startswith("exit:"):
    sys.exit(int(mode.split(":", 1)[1]))
if mode == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
while True:
    time.sleep(0.1)
