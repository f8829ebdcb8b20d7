"""Deployment files agree with the lock, with each other and with the code they ship.

No Docker engine is needed: the Dockerfiles are linted with hadolint and read as text, the compose files are
interpolated and checked structurally (and by `docker compose config` where the compose plugin exists), and
airflow.cfg.example is checked against Airflow's own option list.
"""

from __future__ import annotations

import ast
import configparser
import importlib.metadata
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
TRAINER_DOCKERFILE = DOCKER / "trainer.Dockerfile"
AIRFLOW_DOCKERFILE = DOCKER / "airflow.Dockerfile"
COMPOSE = DOCKER / "docker-compose.yaml"
COMPOSE_GPU = DOCKER / "docker-compose.gpu.yaml"
ENV_EXAMPLE = DOCKER / ".env.example"
CFG_EXAMPLE = REPO / "airflow.cfg.example"
REQUIREMENTS = {
    "trainer": DOCKER / "requirements-trainer.txt",
    "trainer-cuda": DOCKER / "requirements-trainer-cuda.txt",
    "airflow": DOCKER / "requirements-airflow.txt",
}
# Importable project code: the repository's packages and everything in plugins/ (on sys.path under Airflow).
FIRST_PARTY = ({"core", "launcher", "trainer", "tasks", "dags", "bench"}
               | {path.stem for path in (REPO / "plugins").iterdir()})
AIRFLOW_COMPONENTS = {
    "airflow-apiserver": "api-server",
    "airflow-scheduler": "scheduler",
    "airflow-dag-processor": "dag-processor",
    "airflow-triggerer": "triggerer",
    "airflow-worker": "celery worker -q default -H default@%h",
    "airflow-worker-gpu": "celery worker -q gpu -H gpu@%h -c 1",
}


# -- helpers ----------------------------------------------------------------------------------------------------


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_versions() -> dict[str, set[str]]:
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    versions: dict[str, set[str]] = {}
    for package in lock["package"]:
        versions.setdefault(canonical(package["name"]), set()).add(package["version"])
    return versions


def lock_python() -> str:
    """'3.11' from the lock's requires-python '==3.11.*'."""
    spec = tomllib.loads((REPO / "uv.lock").read_text())["requires-python"]
    match = re.fullmatch(r"==(\d+\.\d+)\.\*", spec)
    assert match, f"uv.lock requires-python {spec!r} does not name one minor version: the image tag cannot follow it"
    return match.group(1)


def requirement_pins(path: Path) -> dict[str, str]:
    """name -> pinned version of a requirements file; any line that is not `name==version [; marker]` fails."""
    pins = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)(\s*;.*)?", line)
        assert match, f"{path.name}:{number}: {line!r} is not an exact pin (name==version)"
        pins[canonical(match.group(1))] = match.group(2)
    return pins


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    instructions, pending = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, args = (pending + stripped).partition(" ")
        instructions.append((keyword.upper(), " ".join(args.split())))
        pending = ""
    return instructions


def instruction_args(path: Path, keyword: str) -> list[str]:
    return [args for name, args in dockerfile_instructions(path) if name == keyword]


def dockerfile_env(path: Path) -> dict[str, str]:
    env = {}
    for args in instruction_args(path, "ENV"):
        env.update(dict(re.findall(r"(\w+)=(\S+)", args)))
    return env


def copy_sources(path: Path) -> list[str]:
    sources = []
    for args in instruction_args(path, "COPY"):
        parts = [part for part in args.split() if not part.startswith("--")]
        sources.extend(parts[:-1])
    return sources


def env_example() -> dict[str, str]:
    values = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, value = line.partition("=")
            values[name.strip()] = value.strip()
    return values


def filled_env() -> dict[str, str]:
    """docker/.env.example with every empty secret given a placeholder, as an operator would fill it in."""
    return {name: value or f"placeholder{index}" for index, (name, value) in enumerate(env_example().items())}


_INTERPOLATION = re.compile(r"\$\$|\$\{(\w+)(?:(:-|:\?)([^}]*))?\}")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution for the forms these files use: ${VAR}, ${VAR:-default}, ${VAR:?error}, $$."""

    def substitute(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name, operator, argument = match.groups()
        value = env.get(name, "")
        if operator == ":-":
            return value or argument
        if operator == ":?" and not value:
            raise KeyError(f"{name}: {argument}")
        return value

    return _INTERPOLATION.sub(substitute, text)


def load_compose(*paths: Path, env: dict[str, str] | None = None) -> dict:
    """The files merged the way compose merges mappings (later files win), after interpolation."""
    merged: dict = {}
    for path in paths:
        merge_into(merged, yaml.safe_load(interpolate(path.read_text(), env or filled_env())))
    return merged


def merge_into(base: dict, override: dict) -> None:
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge_into(base[key], value)
        else:
            base[key] = value


def gpu_reservations(service: dict) -> list[dict]:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def imported_names(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return names


def worker_side_files() -> list[Path]:
    """What runs in the trainer image: the trainer, the SSH agent, and every core and launcher module they import (the
    launcher's SSH and Kubernetes backends run on the Airflow side)."""
    found, todo = set(), [*sorted((REPO / "trainer").rglob("*.py")), REPO / "launcher" / "agent.py"]
    while todo:
        path = todo.pop()
        if path in found:
            continue
        found.add(path)
        for name in imported_names(path):
            parts = name.split(".")
            if parts[0] in ("core", "launcher"):
                module = REPO.joinpath(*parts)
                todo += [candidate for candidate in (module.with_suffix(".py"), module / "__init__.py")
                         if candidate.is_file()]
    return sorted(found)


def third_party_imports(*roots: Path) -> dict[str, str]:
    """Top-level module -> first file importing it, for every non-stdlib, non-project import in roots (files, or
    folders read whole)."""
    modules: dict[str, str] = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")) if root.is_dir() else [root]:
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in FIRST_PARTY and top != "__future__":
                        modules.setdefault(top, str(path.relative_to(REPO)))
    return modules


# -- requirements and lock --------------------------------------------------------------------------------------


def test_every_pin_matches_the_lock():
    lock = lock_versions()
    for role, path in REQUIREMENTS.items():
        pins = requirement_pins(path)
        assert pins, f"{path.name} pins nothing"
        wrong = {name: version for name, version in pins.items() if version not in lock.get(name, set())}
        assert not wrong, (f"{path.name} ({role}) pins versions uv.lock does not have: {wrong}; "
                           "run docker/export-requirements.sh")


def test_requirements_files_are_the_current_lock_export():
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH; `make setup` installs it")
    script = (DOCKER / "export-requirements.sh").read_text()
    written_by_script = set(re.findall(r"-o (docker/requirements-[\w-]+\.txt)", script))
    assert written_by_script == {str(path.relative_to(REPO)) for path in REQUIREMENTS.values()}
    for path in REQUIREMENTS.values():
        header = next(line for line in path.read_text().splitlines() if line.lstrip("# ").startswith("uv export"))
        args = header.lstrip("# ").split()[2:]
        output_at = args.index("-o")
        del args[output_at:output_at + 2]
        fresh = subprocess.run([uv, "export", *args], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
        assert requirement_pins(path) == {
            name: version for name, version in (
                (canonical(line.split("==")[0]), line.split("==")[1].split(";")[0].strip())
                for line in fresh.stdout.splitlines() if line and not line.startswith("#")
            )
        }, f"{path.name} is stale against uv.lock: run docker/export-requirements.sh"


def test_dependency_split():
    trainer, cuda, airflow = (requirement_pins(REQUIREMENTS[role]) for role in ("trainer", "trainer-cuda", "airflow"))
    for package in ("tensorflow", "tf-keras", "transformers", "tokenizers", "datasets", "fsspec", "s3fs",
                    "nvidia-ml-py"):
        assert package in trainer, f"requirements-trainer.txt lacks {package}"
    assert "apache-airflow" not in trainer, "the worker image must not carry Airflow"
    assert {"tensorflow", "tf-keras"}.isdisjoint(airflow), "requirements-airflow.txt must not carry TensorFlow"
    assert airflow.get("apache-airflow") == max(lock_versions()["apache-airflow"])
    assert trainer.items() <= cuda.items() and "nvidia-cudnn-cu12" in cuda


@pytest.mark.parametrize(
    ("role", "roots"),
    [("trainer", None), ("airflow", ("dags", "launcher", "plugins", "tasks"))],
)
def test_every_imported_package_is_in_its_image(role, roots):
    installed = importlib.metadata.packages_distributions()
    pins = requirement_pins(REQUIREMENTS[role])
    missing = {
        module: where for module, where in third_party_imports(*(
            worker_side_files() if roots is None else [REPO / root for root in roots])).items()
        if not any(canonical(dist) in pins for dist in installed.get(module, [module]))
    }
    assert not missing, f"imported but not in requirements-{role}.txt (module: first importer): {missing}"


# -- Dockerfiles ------------------------------------------------------------------------------------------------


def test_hadolint_passes_on_both_dockerfiles():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    result = subprocess.run([hadolint, "--no-color", str(TRAINER_DOCKERFILE), str(AIRFLOW_DOCKERFILE)],
                            check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_base_images_follow_the_lock():
    lock = lock_versions()
    (tensorflow,), (airflow,) = lock["tensorflow"], lock["apache-airflow"]
    assert instruction_args(TRAINER_DOCKERFILE, "FROM") == [f"tensorflow/tensorflow:{tensorflow}-gpu"]
    assert instruction_args(AIRFLOW_DOCKERFILE, "FROM") == [f"apache/airflow:{airflow}-python{lock_python()}"]


def test_trainer_image_ships_only_the_worker():
    # The worker side: the shared core, the launcher (SSH hosts run its agent) and the trainer; no Airflow glue.
    assert copy_sources(TRAINER_DOCKERFILE) == ["docker/requirements-trainer.txt", "core/", "launcher/", "trainer/"]
    assert "--requirement /tmp/requirements-trainer.txt" in " ".join(instruction_args(TRAINER_DOCKERFILE, "RUN"))
    env = dockerfile_env(TRAINER_DOCKERFILE)
    assert env["TF_USE_LEGACY_KERAS"] == "1"
    users = instruction_args(TRAINER_DOCKERFILE, "USER")
    assert users and users[-1] not in {"0", "root"}, "the worker must not run as root"
    (healthcheck,) = instruction_args(TRAINER_DOCKERFILE, "HEALTHCHECK")
    assert healthcheck.endswith('CMD ["python3", "-c", "import trainer.preflight.__main__"]')
    install_dir = env["PYTHONPATH"]
    copies = instruction_args(TRAINER_DOCKERFILE, "COPY")
    assert any(args.endswith(f"trainer/ {install_dir}/trainer/") for args in copies)
    assert any(args.endswith(f"launcher/ {install_dir}/launcher/") for args in copies)
    assert any(args.endswith(f"core/ {install_dir}/core/") for args in copies)


def test_the_preflight_import_is_cheap():
    """The image's HEALTHCHECK imports the preflight's entry point every minute: it must not pull in TensorFlow."""
    probe = ("import sys, trainer.preflight.__main__; "
             "print(sorted({'tensorflow', 'tf_keras', 'transformers'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, check=False, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"import trainer.preflight.__main__ loads {result.stdout.strip()}"


def test_airflow_image_layout_matches_the_repository_and_the_config():
    env = dockerfile_env(AIRFLOW_DOCKERFILE)
    project = "/opt/airflow/project"
    for part in ("dags", "plugins", "tasks", "trainer", "data/sample"):
        assert f"{part}/ {project}/{part}/" in " ".join(instruction_args(AIRFLOW_DOCKERFILE, "COPY")), part
    assert env["PYTHONPATH"].split(":") == [project, f"{project}/plugins"]
    production = production_config()
    assert env["AIRFLOW__CORE__DAGS_FOLDER"] == production["core"]["dags_folder"] == f"{project}/dags"
    assert env["AIRFLOW__CORE__PLUGINS_FOLDER"] == production["core"]["plugins_folder"] == f"{project}/plugins"
    installs = " ".join(instruction_args(AIRFLOW_DOCKERFILE, "RUN"))
    for path in REQUIREMENTS.values():
        assert f"--requirement /tmp/requirements/{path.name}" in installs, path.name


def docker_context_includes(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last pattern matching the path or one of its parents decides."""
    included = True
    candidates = [path] + [str(parent) for parent in Path(path).parents if str(parent) != "."]
    for pattern in patterns:
        negated = pattern.startswith("!")
        glob = pattern.lstrip("!").strip("/")
        regex = re.escape(glob).replace(r"\*\*", ".*").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, candidate) for candidate in candidates):
            included = negated
    return included


def test_dockerignore_sends_what_the_images_copy_and_nothing_private():
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for source in copy_sources(TRAINER_DOCKERFILE) + copy_sources(AIRFLOW_DOCKERFILE):
        files = [source] if (REPO / source).is_file() else [
            str(path.relative_to(REPO)) for path in (REPO / source).rglob("*")
            if path.is_file() and "__pycache__" not in path.parts
        ]
        assert files, f"COPY source {source} is empty"
        excluded = [name for name in files if not docker_context_includes(name, patterns)]
        assert not excluded, f".dockerignore keeps {excluded} out of the build context, but a COPY needs them"
    for private in (".venv/bin/python", ".git/config", "storage/runs/x", ".airflow/airflow.db", "docker/.env",
                    "trainer/__pycache__/config.cpython-311.pyc"):
        assert not docker_context_includes(private, patterns), f"{private} would be sent to the Docker daemon"


# -- compose ----------------------------------------------------------------------------------------------------


def compose_plugin() -> str | None:
    docker = shutil.which("docker")
    if docker is None:
        return None
    probe = subprocess.run([docker, "compose", "version"], check=False, capture_output=True, text=True, timeout=30)
    return docker if probe.returncode == 0 else None


def test_docker_compose_config_accepts_the_stack(tmp_path):
    docker = compose_plugin()
    if docker is None:
        pytest.skip("no `docker compose` plugin here: the structural checks below stand in for it")
    env_file = tmp_path / ".env"
    env_file.write_text("".join(f"{name}={value}\n" for name, value in filled_env().items()))
    for files in ([COMPOSE], [COMPOSE, COMPOSE_GPU]):
        args = [arg for path in files for arg in ("-f", str(path))]
        result = subprocess.run([docker, "compose", "--env-file", str(env_file), *args, "config", "--quiet"],
                                check=False, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr


def test_compose_refuses_to_start_without_each_secret():
    secrets = [name for name, value in env_example().items() if not value]
    assert {"POSTGRES_PASSWORD", "MINIO_ROOT_PASSWORD", "S3_SECRET_ACCESS_KEY", "AIRFLOW_JWT_SECRET",
            "GRAFANA_ADMIN_PASSWORD"} <= set(secrets)
    for secret in secrets:
        with pytest.raises(KeyError, match=f"{secret}: set {secret} in docker/.env"):
            load_compose(COMPOSE, env={**filled_env(), secret: ""})


def test_env_example_declares_every_variable_the_compose_files_use():
    used = set()
    for path in (COMPOSE, COMPOSE_GPU):
        used |= {match.group(1) for match in _INTERPOLATION.finditer(path.read_text()) if match.group(1)}
    assert used <= set(env_example()), f"missing from docker/.env.example: {sorted(used - set(env_example()))}"


def test_compose_services_and_wiring():
    compose = load_compose(COMPOSE)
    services = compose["services"]
    assert {"postgres", "minio", "minio-init", "airflow-init", "trainer", *AIRFLOW_COMPONENTS} <= set(services)

    for name, service in services.items():
        image = service["image"]
        assert re.fullmatch(r"[\w./-]+:[\w.-]+", image) and not image.endswith(":latest"), f"{name}: pin {image}"
        for dependency, condition in service.get("depends_on", {}).items():
            assert dependency in services, f"{name} depends on unknown service {dependency}"
            assert condition["condition"] in {"service_healthy", "service_completed_successfully"}
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency], f"{name} waits for {dependency}, which has no healthcheck"

    for name, command in AIRFLOW_COMPONENTS.items():
        service = services[name]
        assert service["command"] == command
        assert service["build"]["dockerfile"] == "docker/airflow.Dockerfile"
        assert (COMPOSE.parent / service["build"]["context"]).resolve() == REPO
        assert service["depends_on"]["airflow-init"]["condition"] == "service_completed_successfully"
        assert service["depends_on"]["minio-init"]["condition"] == "service_completed_successfully"
        assert "healthcheck" in service, name
    trainer = services["trainer"]
    assert trainer["build"]["dockerfile"] == "docker/trainer.Dockerfile"
    assert trainer["profiles"], "the GPU worker must not start on hosts without GPUs"
    assert any(device["driver"] == "nvidia" and "gpu" in device["capabilities"] for device in gpu_reservations(trainer))


def test_compose_airflow_settings_agree():
    services = load_compose(COMPOSE)["services"]
    env = services["airflow-worker-gpu"]["environment"]  # where tasks run: Airflow's settings and the S3 user's
    api_port = int(env["AIRFLOW__API__PORT"])
    execution = urlparse(env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"])
    assert (execution.hostname, execution.port, execution.path) == ("airflow-apiserver", api_port, "/execution/")
    assert any(str(mapping).endswith(f":{api_port}") for mapping in services["airflow-apiserver"]["ports"])
    assert f"localhost:{api_port}/" in " ".join(services["airflow-apiserver"]["healthcheck"]["test"])

    database = urlparse(env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"])
    assert database.scheme.startswith("postgresql") and database.hostname == "postgres"
    assert database.password == services["postgres"]["environment"]["POSTGRES_PASSWORD"]

    connection_id = env["AIRFLOW__LOGGING__REMOTE_LOG_CONN_ID"]
    connection = json.loads(env[f"AIRFLOW_CONN_{connection_id.upper()}"])
    assert connection["conn_type"] == "aws"
    assert urlparse(connection["extra"]["endpoint_url"]).hostname == "minio"
    assert connection["login"] == env["AWS_ACCESS_KEY_ID"] == services["minio-init"]["environment"]["S3_ACCESS_KEY_ID"]

    bucket_setup = " ".join(services["minio-init"]["command"])
    for url in (env["GPT_FINETUNE_STORAGE_ROOT"], env["AIRFLOW__LOGGING__REMOTE_BASE_LOG_FOLDER"]):
        assert f"local/{urlparse(url).netloc}" in bucket_setup, f"minio-init does not create the bucket of {url}"
    assert "airflow pools set gpu_slots" in " ".join(services["airflow-init"]["command"])

    for name in AIRFLOW_COMPONENTS:
        assert services[name]["environment"]["AIRFLOW__API_AUTH__JWT_SECRET"] == env["AIRFLOW__API_AUTH__JWT_SECRET"]


def test_compose_runs_celery_with_a_worker_per_queue():
    """CeleryExecutor on Redis; the gpu worker serves the queue the GPU tasks go to, the other one the rest, and a
    delivery timeout longer than a long training run (the provider's 24 h default redelivers and kills it)."""
    services = load_compose(COMPOSE)["services"]
    env = services["airflow-scheduler"]["environment"]
    assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    assert urlparse(env["AIRFLOW__CELERY__BROKER_URL"]).hostname == "redis" and "healthcheck" in services["redis"]
    backend = urlparse(env["AIRFLOW__CELERY__RESULT_BACKEND"].removeprefix("db+"))
    assert backend.hostname == "postgres"
    assert backend.password == services["postgres"]["environment"]["POSTGRES_PASSWORD"]
    assert int(env["AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__VISIBILITY_TIMEOUT"]) > 24 * 3600
    queues = {name: services[name]["command"].split("-q ")[1].split()[0] for name in ("airflow-worker",
                                                                                        "airflow-worker-gpu")}
    assert queues == {"airflow-worker": "default", "airflow-worker-gpu": env["GPT_FINETUNE_GPU_QUEUE"]}
    for name, queue in queues.items():
        worker = services[name]
        assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
        assert worker["environment"]["DUMB_INIT_SETSID"] == "0"  # warm shutdown: running tasks finish
        assert f"-d {queue}@${{HOSTNAME}}" in " ".join(worker["healthcheck"]["test"])
    assert services["airflow-worker-gpu"]["shm_size"] and "shm_size" not in services["airflow-scheduler"]


def test_compose_keeps_the_api_server_private_and_storage_access_scoped(tmp_path):
    services = load_compose(COMPOSE)["services"]
    env = services["airflow-worker-gpu"]["environment"]
    api = services["airflow-apiserver"]
    assert api["ports"] == [f"127.0.0.1:{env['AIRFLOW__API__PORT']}:8080"]  # loopback unless AIRFLOW_BIND says so
    for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        assert api["environment"][variable] == env[variable], f"the reports pages need {variable}"

    buckets = {urlparse(env[name]).netloc for name in ("GPT_FINETUNE_STORAGE_ROOT",
                                                        "AIRFLOW__LOGGING__REMOTE_BASE_LOG_FOLDER")}
    assert env["GPT_FINETUNE_S3_BUCKETS"] == urlparse(env["GPT_FINETUNE_STORAGE_ROOT"]).netloc
    # ... and only the stack's own storage connection, an aws one (core/config/access.py).
    assert json.loads(env[f"AIRFLOW_CONN_{env['GPT_FINETUNE_STORAGE_CONN_IDS'].upper()}"])["conn_type"] == "aws"
    (script,) = services["minio-init"]["command"]
    assert "readwrite --user" not in script.replace("detach local readwrite --user", "")  # never attached
    policy = json.loads(re.search(r"<<'POLICY'\n(.*?)\nPOLICY\n", script, re.DOTALL).group(1))
    resources = {arn for statement in policy["Statement"] for arn in statement["Resource"]}
    assert {arn.removeprefix("arn:aws:s3:::").split("/")[0] for arn in resources} == buckets
    assert all(statement["Effect"] == "Allow" and not any("*" in action for action in statement["Action"])
               for statement in policy["Statement"])
    assert 'policy attach local gpt-finetune-pipeline --user "$S3_ACCESS_KEY_ID"' in script
    (tmp_path / "minio-init.sh").write_text(script)
    syntax = subprocess.run(["sh", "-n", str(tmp_path / "minio-init.sh")], capture_output=True, text=True, check=False)
    assert syntax.returncode == 0, syntax.stderr


def test_compose_holds_no_literal_secrets():
    raw = yaml.safe_load(COMPOSE.read_text())
    secret_name = re.compile(r"PASSWORD|SECRET|FERNET|ACCESS_KEY")
    for name, service in raw["services"].items():
        for variable, value in (service.get("environment") or {}).items():
            if secret_name.search(variable):
                assert re.fullmatch(r"\$\{\w+:\?[^}]+\}", str(value)), f"{name}: {variable} must come from docker/.env"


def test_gpu_override_reserves_gpus_for_the_local_workers():
    override = yaml.safe_load(COMPOSE_GPU.read_text())
    assert set(override["services"]) <= set(yaml.safe_load(COMPOSE.read_text())["services"])
    worker = load_compose(COMPOSE, COMPOSE_GPU)["services"]["airflow-worker-gpu"]
    assert any(device["driver"] == "nvidia" and "gpu" in device["capabilities"]
               for device in gpu_reservations(worker))
    assert worker["command"] == AIRFLOW_COMPONENTS["airflow-worker-gpu"], "the override must only add the reservation"


# -- airflow.cfg.example ----------------------------------------------------------------------------------------


def production_config() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_string(CFG_EXAMPLE.read_text())
    return parser


def airflow_options() -> dict[str, dict[str, dict]]:
    """Airflow core's options and the Celery provider's (its executor's sections)."""
    from airflow.providers.celery.get_provider_info import get_provider_info

    spec = importlib.util.find_spec("airflow")
    config_yml = Path(spec.submodule_search_locations[0]) / "config_templates" / "config.yml"
    sections = {**yaml.safe_load(config_yml.read_text()), **get_provider_info()["config"]}
    return {section: body["options"] for section, body in sections.items()}


def development_settings() -> dict[tuple[str, str], str]:
    """The '#   [section] key = value' lines of the example's local-development block."""
    lines = re.findall(r"^#\s+\[(\w+)\] (\w+) = (.*)$", CFG_EXAMPLE.read_text(), flags=re.MULTILINE)
    return {(section, key): value.strip() for section, key, value in lines}


def test_development_block_mirrors_airflow_env_script(tmp_path):
    airflow_home = tmp_path / "airflow-home"
    script = REPO / "scripts" / "airflow-env.sh"
    result = subprocess.run(["bash", "-c", f"source {script} && env"], capture_output=True, text=True, timeout=30,
                            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "AIRFLOW_HOME": str(airflow_home)},
                            check=True)
    exported = {}
    for line in result.stdout.splitlines():
        match = re.fullmatch(r"AIRFLOW__([A-Z_]+?)__([A-Z_]+)=(.*)", line)
        if match:
            exported[(match.group(1).lower(), match.group(2).lower())] = match.group(3)
    documented = {key: value.replace("<repo>", str(REPO)).replace("<AIRFLOW_HOME>", str(airflow_home))
                  for key, value in development_settings().items()}
    assert documented == exported


def test_production_config_uses_only_real_airflow_options():
    options = airflow_options()
    for section in production_config().sections():
        assert section in options, f"airflow.cfg.example: [{section}] is not an Airflow section"
        for key in production_config()[section]:
            base, _, suffix = key.rpartition("_")
            if suffix in {"secret", "cmd"} and base in options[section]:
                assert options[section][base].get("sensitive"), f"[{section}] {key}: {base} takes no _{suffix} form"
                continue
            assert key in options[section], f"airflow.cfg.example: [{section}] {key} is not an Airflow option"


def test_production_config_is_complete_and_keeps_secrets_out():
    cfg = production_config()
    options = airflow_options()
    credential = re.compile(r"password|secret|token|access_key|credential", re.IGNORECASE)
    for section, keys in options.items():
        for key, spec in keys.items():
            if not (spec.get("sensitive") and cfg.has_option(section, key)):
                continue
            # Sensitive because they *may* hold credentials: kwargs in clear are fine when they hold none.
            assert key.endswith("kwargs"), f"[{section}] {key} is written in clear: use {key}_secret"
            leaked = [name for name in json.loads(cfg[section][key]) if credential.search(name)]
            assert not leaked, f"[{section}] {key} holds credentials {leaked}: use {key}_secret"
    assert cfg.has_option("database", "sql_alchemy_conn_secret")
    assert cfg.has_option("core", "fernet_key_secret") and cfg.has_option("api_auth", "jwt_secret_secret")

    execution = urlparse(cfg["core"]["execution_api_server_url"])
    assert execution.port == cfg.getint("api", "port") and execution.path == "/execution/"
    assert cfg["core"]["executor"] == "CeleryExecutor" and cfg.getint("core", "parallelism") > 0
    assert cfg.has_option("celery", "broker_url_secret") and cfg.has_option("celery", "result_backend_secret")
    assert cfg.getint("celery_broker_transport_options", "visibility_timeout") > 24 * 3600
    assert cfg.getboolean("logging", "remote_logging")
    assert cfg["logging"]["remote_base_log_folder"].startswith("s3://") and cfg["logging"]["remote_log_conn_id"]
    for section, backend, kwargs in (("secrets", "backend", "backend_kwargs"),
                                     ("workers", "secrets_backend", "secrets_backend_kwargs")):
        assert cfg[section][backend].count(".") >= 2, f"[{section}] {backend} must be a class path"
        assert isinstance(json.loads(cfg[section][kwargs]), dict)
    assert "airflow pools set gpu_slots" in CFG_EXAMPLE.read_text()

    # Every setting local development makes has a production value, except the dev-only simple auth manager.
    dev_only = {("core", "simple_auth_manager_users"), ("core", "simple_auth_manager_passwords_file")}
    for section, key in set(development_settings()) - dev_only:
        assert cfg.has_option(section, key) or cfg.has_option(section, f"{key}_secret"), f"[{section}] {key}"
