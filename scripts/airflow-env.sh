# Sourced by the Makefile, the tests and by people: a project-local Airflow home, nothing global.
# Usage: source scripts/airflow-env.sh
_repo="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)"
export AIRFLOW_HOME="${AIRFLOW_HOME:-$_repo/.airflow}"
export AIRFLOW_PORT="${AIRFLOW_PORT:-8080}"
export AIRFLOW__CORE__DAGS_FOLDER="${AIRFLOW__CORE__DAGS_FOLDER:-$_repo/dags}"
export AIRFLOW__CORE__PLUGINS_FOLDER="$_repo/plugins"
export AIRFLOW__CORE__LOAD_EXAMPLES=False
export AIRFLOW__CORE__EXECUTOR=LocalExecutor
# The LocalExecutor keeps this many worker processes alive: the default (32) costs ~5 GB of memory for nothing
# on a workstation, where a run executes one task at a time.
export AIRFLOW__CORE__PARALLELISM="${AIRFLOW__CORE__PARALLELISM:-4}"
export AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION=False
# SQLite lets one writer in at a time, and Python's sqlite3 gives up after waiting 5 s for the lock: on a busy
# machine the API then answers 500 ("database is locked": a run marked failed from the UI that stays running). 30 s.
export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="${AIRFLOW__DATABASE__SQL_ALCHEMY_CONN:-sqlite:///$AIRFLOW_HOME/airflow.db?timeout=30}"
export AIRFLOW__API__PORT="$AIRFLOW_PORT"
# Tasks reach the scheduler's execution API on the API server: the URL must name the same port (set it only when
# tasks reach the API server through another address, e.g. a proxy).
export AIRFLOW__CORE__EXECUTION_API_SERVER_URL="${AIRFLOW__CORE__EXECUTION_API_SERVER_URL:-http://localhost:$AIRFLOW_PORT/execution/}"
# A task retries a refused or failed execution API call for at least 24 x 5 s = 2 minutes (Airflow's default gives up
# after 4-15 s): standalone starts the scheduler next to a still-loading API server, and a run due at start-up
# would otherwise fail its first task with "connection refused".
export AIRFLOW__WORKERS__EXECUTION_API_RETRIES="${AIRFLOW__WORKERS__EXECUTION_API_RETRIES:-25}"
export AIRFLOW__WORKERS__EXECUTION_API_RETRY_WAIT_MIN="${AIRFLOW__WORKERS__EXECUTION_API_RETRY_WAIT_MIN:-5}"
export AIRFLOW__WORKERS__EXECUTION_API_RETRY_WAIT_MAX="${AIRFLOW__WORKERS__EXECUTION_API_RETRY_WAIT_MAX:-15}"
# A task marked failed (UI, API) learns it from its next heartbeat, up to two intervals later (Airflow: 5 s); its
# workers hold GPUs until then.
export AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL="${AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL:-2}"
export AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS="${AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS:-admin:admin}"
export AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE="$AIRFLOW_HOME/simple_auth_manager_passwords.json"
export AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="${AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL:-5}"
export GPT_FINETUNE_STORAGE_ROOT="${GPT_FINETUNE_STORAGE_ROOT:-$_repo/storage}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
# Child commands of `airflow standalone` look up `airflow` on PATH.
export PATH="$_repo/.venv/bin:$PATH"
mkdir -p "$AIRFLOW_HOME"
unset _repo
