"""The GPU-time ledger: the launch path's events, the price, release.json's usage (tasks/ledger/)."""
