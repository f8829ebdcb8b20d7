"""Preflight: every worker checks itself, then the group runs collectives with known answers and measures them.

    python -m trainer.preflight --config URL --manifest URL --output REPORT_DIR_URL

- `checks`: per worker, no TensorFlow: host, rank, versions, visible GPUs (NVML) with memory, free disk for shard
  staging, reading the manifest and this rank's shards, writing to `storage_root`. The result goes to
  `<output>/preflight/rank-<r>.json`: a side channel that still works when the collectives do not, so the chief
  can say which ranks answered.
- `collectives`: with `MultiWorkerMirroredStrategy` created as training creates it (`trainer/strategy.py`), an
  all-reduce whose exact answer names every rank, a broadcast, a bandwidth and a latency probe, and whether this
  worker's unauthenticated TF port answers off loopback (docs/security.md), all in a child process that the
  worker kills past `collective_timeout_s`.
- `verdict`: the chief compares versions and the fingerprint of this project's code across ranks (skew is an
  error), explains failed collectives, and prints a one-screen summary.
- `advice`: the scaling advisor (`trainer/advisor.py`) on the measured collectives and a single-worker step time
  (the reused baseline's, or a few-step probe bounded by `hang_timeout_s`); below `min_predicted_efficiency` is
  an error.
- `__main__`: the worker's entry point; the chief writes `<output>/preflight.json`. Any error exits non-zero, so
  training never launches.
"""
