# Airflow image for every component (API server, scheduler, DAG processor, triggerer) with this project's DAG,
# plugins and task code, laid out as in the repository under /opt/airflow/project.
#
# LOCAL_WORKERS decides whether training workers can run inside this image:
#   none  workers run elsewhere (e.g. the trainer image): no TensorFlow here, a much smaller image
#   cpu   the `local` launcher backend starts workers in the task's container, on CPUs (default)
#   gpu   the same on GPUs: adds the CUDA wheels, since this base image has no CUDA of its own
#
# Build from the repository root:
#   docker build -f docker/airflow.Dockerfile --build-arg LOCAL_WORKERS=cpu -t gpt-finetune-airflow:3.3.2-cpu .
FROM apache/airflow:3.3.2-python3.11

ARG LOCAL_WORKERS=cpu

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    AIRFLOW__CORE__DAGS_FOLDER=/opt/airflow/project/dags \
    AIRFLOW__CORE__PLUGINS_FOLDER=/opt/airflow/project/plugins \
    AIRFLOW__CORE__LOAD_EXAMPLES=False \
    PYTHONPATH=/opt/airflow/project:/opt/airflow/project/plugins \
    GPT_FINETUNE_STORAGE_ROOT=/opt/airflow/storage \
    TF_USE_LEGACY_KERAS=1 \
    TF_CPP_MIN_LOG_LEVEL=2

COPY docker/requirements-airflow.txt docker/requirements-trainer.txt docker/requirements-trainer-cuda.txt \
     /tmp/requirements/
# requirements-airflow.txt pins apache-airflow to the base image's version, so pip never moves Airflow itself.
RUN pip install --no-cache-dir --requirement /tmp/requirements/requirements-airflow.txt
# A layer of its own: the Airflow-side layer above is shared by all three variants.
RUN case "${LOCAL_WORKERS}" in \
      none) ;; \
      cpu) pip install --no-cache-dir --requirement /tmp/requirements/requirements-trainer.txt ;; \
      gpu) pip install --no-cache-dir --requirement /tmp/requirements/requirements-trainer-cuda.txt ;; \
      *) echo "LOCAL_WORKERS=${LOCAL_WORKERS} is not one of none, cpu, gpu" >&2; exit 1 ;; \
    esac

# Code stays root-owned: the airflow user runs it but cannot change it, so the default storage root above lies in
# the writable AIRFLOW_HOME. data/sample is the DAG's default dataset ("data/sample/*.txt", relative to the
# repository, which tasks find next to their own package).
COPY core/ /opt/airflow/project/core/
COPY dags/ /opt/airflow/project/dags/
COPY launcher/ /opt/airflow/project/launcher/
COPY plugins/ /opt/airflow/project/plugins/
COPY tasks/ /opt/airflow/project/tasks/
COPY trainer/ /opt/airflow/project/trainer/
COPY data/sample/ /opt/airflow/project/data/sample/
RUN python -c 'import launcher, core.config, core.storage, core.layout, tasks, tf_multiworker'
