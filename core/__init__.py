"""The bottom floor every layer shares: storage, the storage layout, the run configuration, the typed-document base,
the protocol's names and the clock, and the records more than one layer reads. Imports nothing of the project's other
folders; the worker images and the SSH hosts carry it with the launcher and the trainer."""

from pathlib import Path

# The repository: relative settings (the storage root, local data) are taken from here, whatever the cwd. Here, not in
# core/layout.py, so that the config (core/config/access.py) needs no storage library: the DAG file imports it.
REPO_ROOT = Path(__file__).resolve().parents[1]
