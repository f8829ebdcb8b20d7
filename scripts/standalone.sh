#!/usr/bin/env bash
# `make airflow`: Airflow standalone (API server + scheduler + DAG processor + triggerer) on the project-local home,
# plus the GPU pool (scripts/standalone.py).
set -euo pipefail
source "$(dirname "$0")/airflow-env.sh"
passwords="$AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"
if [ ! -s "$passwords" ]; then
  user="${AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS%%:*}"
  python -c "import json, secrets, sys; json.dump({sys.argv[1]: secrets.token_urlsafe(12)}, open(sys.argv[2], 'w'))" \
    "$user" "$passwords"
  chmod 600 "$passwords"
fi
login=$(python -c "import json, sys; u, p = next(iter(json.load(open(sys.argv[1])).items())); print(f'{u} / {p}')" "$passwords")
cat <<MSG
============================================================================
 Airflow UI:  http://localhost:$AIRFLOW_PORT
 Log in as:   $login   (stored in $passwords)
 DAG:         gpt_finetune  (Trigger -> form with every run setting)
 Stop:        Ctrl-C
============================================================================
MSG
exec python "$(dirname "$0")/standalone.py"
