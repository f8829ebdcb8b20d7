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

shown = {name: os.environ.get(name) for name in os.environ.get("AGENT_WORKER_SHOW", "").split(",") if name}
print("env " + json.dumps(shown), flush=True)
child = subprocess.Popen(["sh", "-c", 'trap "" TERM; exec sleep 600'])
print(f"pids {os.getpid()} {child.pid}", flush=True)

mode = os.environ.get("AGENT_WORKER_MODE", "stubborn")
if mode.startswith("exit:"):
    sys.exit(int(mode.split(":", 1)[1]))
if mode == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
signal.signal(signal.SIGTERM, lambda *_: print("TERM ignored", flush=True))
while True:
    time.sleep(0.1)
