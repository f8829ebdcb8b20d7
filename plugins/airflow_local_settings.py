"""This project's cluster policies. Airflow imports `airflow_local_settings` from sys.path in every component at
start-up, and puts the plugins folder on sys.path, so the policies apply wherever this folder is the plugins
folder (`make airflow`, the tests, the images). A deployment with its own airflow_local_settings imports the hook
from tf_multiworker.gpu_admission there instead (the first module of that name on sys.path wins).
"""

from tf_multiworker.gpu_admission import task_instance_mutation_hook

# Airflow copies every other public name of this module into airflow.settings: export the hook only.
__all__ = ["task_instance_mutation_hook"]
