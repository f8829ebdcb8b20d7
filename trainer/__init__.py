"""The worker side: what runs inside each worker, and the core every layer shares (config, storage, layout)."""

from pathlib import Path

# The repository: relative settings (the storage root, local data) are taken from here, whatever the cwd. Here, not in
# trainer/layout.py, so that the config (trainer/config/access.py) needs no storage library: the DAG file imports it.
REPO_ROOT = Path(__file__).resolve().parents[1]
