# Training worker image: one process of a MultiWorkerMirroredStrategy group (trainer.train, trainer.preflight,
# trainer.evaluate). The base image brings CUDA, cuDNN and NCCL; the Python packages come pinned from uv.lock.
#
# Build from the repository root:  docker build -f docker/trainer.Dockerfile -t gpt-finetune-trainer:2.21.0 .
# Run one worker:  docker run --gpus all --rm gpt-finetune-trainer:2.21.0 trainer.train --config URL ...
FROM tensorflow/tensorflow:2.21.0-gpu

# PIP_BREAK_SYSTEM_PACKAGES: the base installs TensorFlow into the system interpreter, and the pins below must
# land next to it (a venv would hide the base image's TensorFlow build).
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONPATH=/opt/gpt-finetune \
    TF_USE_LEGACY_KERAS=1 \
    TF_CPP_MIN_LOG_LEVEL=2

# uv.lock resolves for Python 3.11 only; refuse a base whose interpreter would get untested wheels.
RUN python3 -c 'import sys; v = sys.version_info[:2]; sys.exit(0 if v == (3, 11) else f"tensorflow/tensorflow:2.21.0-gpu has Python {v[0]}.{v[1]}, uv.lock pins Python 3.11: pick a base image with 3.11 or re-lock")'

COPY docker/requirements-trainer.txt /tmp/requirements-trainer.txt
# The lock's tensorflow pin equals the base image's version, so pip keeps the base build and its CUDA libraries.
RUN python3 -m pip install --no-cache-dir --requirement /tmp/requirements-trainer.txt \
    && rm /tmp/requirements-trainer.txt \
    && python3 -c 'import tensorflow as tf, tf_keras, transformers; assert tf.__version__ == "2.21.0", tf.__version__'

# Workers never need write access to their own code: it stays root-owned; the worker writes under its home.
# The worker side only: the shared core (storage, config, the protocol's names), the launcher (the SSH agent) and
# the trainer; no Airflow glue.
COPY core/ /opt/gpt-finetune/core/
COPY launcher/ /opt/gpt-finetune/launcher/
COPY trainer/ /opt/gpt-finetune/trainer/
RUN useradd --no-log-init --create-home --uid 10001 --shell /usr/sbin/nologin trainer
USER 10001
WORKDIR /home/trainer

# The preflight's entry point imports without TensorFlow, so the check costs well under a second.
HEALTHCHECK --interval=60s --timeout=20s --start-period=10s --retries=3 \
    CMD ["python3", "-c", "import trainer.preflight.__main__"]

ENTRYPOINT ["python3", "-m"]
CMD ["trainer.preflight", "--help"]
