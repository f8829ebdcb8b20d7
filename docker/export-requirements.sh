#!/usr/bin/env bash
# Writes the images' pinned requirements from uv.lock, so every image installs exactly what the tests ran with.
# Run after changing uv.lock:  docker/export-requirements.sh   (tests/docker/test_images.py fails when stale)
#
#   requirements-trainer.txt       worker side, no Airflow; for trainer.Dockerfile, whose base image brings CUDA
#   requirements-trainer-cuda.txt  the same plus the CUDA wheels of the `gpu` extra; for an Airflow image that
#                                  runs the local backend's workers on GPUs
#   requirements-airflow.txt       Airflow side (DAG, tasks, plugins), no TensorFlow: enough when workers run remotely
set -euo pipefail
cd "$(dirname "$0")/.."

export_lock() {
  uv export --quiet --frozen --no-hashes --no-dev --no-emit-project --no-annotate "$@"
}

# matplotlib (report charts), pendulum (DAG file), the providers and clients (connections to hosts, the
# Kubernetes API, the Celery executor) and the database drivers are Airflow side only.
worker_side=(--prune apache-airflow --prune matplotlib --prune pendulum --prune apache-airflow-providers-ssh
             --prune apache-airflow-providers-cncf-kubernetes --prune kubernetes
             --prune apache-airflow-providers-celery --prune celery --prune psycopg2-binary --prune asyncpg --prune statsd)

export_lock "${worker_side[@]}" -o docker/requirements-trainer.txt
export_lock "${worker_side[@]}" --extra gpu -o docker/requirements-trainer-cuda.txt
export_lock --prune tensorflow -o docker/requirements-airflow.txt
