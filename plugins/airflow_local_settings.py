"""This project's cluster policies. Airflow imports `airflow_local_settings` from sys.path in every component at
start-up; this folder is on sys.path wherever the project is installed (the editable install's .pth) and wherever
it is Airflow's plugins folder (Airflow adds that; the images), so the policies apply in `make airflow`, the tests,
`airflow dags test` and the images. A deployment with its own airflow_local_settings imports the hook from
tf_multiworker.gpu_admission there instead (the first module of that name on sys.path wins). Library chatter is
left out of the logs here too (launcher/log_policy.py).
"""

from tf_multiworker.gpu_admission import task_instance_mutation_hook

from launcher.log_policy import quiet_libraries

quiet_libraries()  # every component imports this module at start-up: the one place the Airflow side is quieted

# Airflow copies every other public name of this module into airflow.settings: export the hook only.
__all__ = ["task_instance_mutation_hook"]
