"""The README and docs/ stay current: the README stays an entry point that links every page, links reach their
pages and headings, the settings table lists every run setting, and every command shown is one that works today."""

import importlib.util
import json
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from core.config import ConfigError, RunConfig, field_names
from core.config.access import ALLOW_LISTS

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
DOCS = REPO / "docs"
PAGES = {path: path.read_text() for path in [REPO / "README.md", *sorted(DOCS.glob("*.md"))]}
# An argument under one of these names a file of the repository (a glob is fine); elsewhere a path is the reader's.
REPO_FOLDERS = ("bench", "core", "dags", "data", "docker", "docs", "plugins", "scripts", "tasks", "tests", "trainer")
# A command in running text: backticks around a span that starts with one of these words.
INLINE_COMMAND = re.compile(r"`((?:make|airflow|python|\.venv/bin/python|uv|docker) [^`]+)`")


def _split(command: str) -> list[list[str]] | None:
    """The words of each command of a line (`a && b` is two), or None while a quote is still open."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return None
    commands, current = [], []
    for word in words:
        if word == "&&":
            commands, current = [*commands, current], []
        else:
            current.append(word)
    return [c for c in [*commands, current] if c]


def block_commands(text: str) -> list[list[str]]:
    """The commands of the page's shell blocks, as words: continued lines (a trailing backslash, an open quote)
    joined, comment lines dropped."""
    commands = []
    for block in re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL):
        pending = ""
        for line in block.splitlines():
            continued = line.rstrip().endswith("\\")
            pending = " ".join(filter(None, [pending, line.rstrip().removesuffix("\\")]))
            parsed = None if continued else _split(pending)
            if parsed is not None:
                commands += parsed
                pending = ""
        assert not pending, f"an unfinished command in a shell block: {pending}"
    return commands


def inline_commands(text: str) -> list[list[str]]:
    """The commands quoted in running text (`make demo-s3`), which may wrap across lines."""
    commands = []
    for span in INLINE_COMMAND.findall(text):
        parsed = _split(" ".join(span.split()))
        assert parsed is not None, f"an unbalanced quote in `{span}`"
        commands += parsed
    return commands


BLOCK_COMMANDS = [(path.relative_to(REPO), words) for path, text in PAGES.items() for words in block_commands(text)]
ALL_COMMANDS = BLOCK_COMMANDS + [(path.relative_to(REPO), words) for path, text in PAGES.items()
                                 for words in inline_commands(text)]


def _heading_anchors(text: str) -> set[str]:
    """GitHub's anchors for the page's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL),
                          flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_the_readme_stays_an_entry_point():
    assert len(README.splitlines()) < 200
    assert "make demo" in README and "make test" in README


def test_the_readme_links_every_docs_page_and_each_exists():
    linked = set(re.findall(r"\]\((docs/[^)#\s]+)", README))
    assert linked, "the README links no page under docs/"
    assert {link for link in linked if not (REPO / link).is_file()} == set()
    assert {f"docs/{page.name}" for page in DOCS.glob("*.md")} - linked == set(), "pages the README does not link"


def test_links_between_the_pages_reach_a_file_and_its_heading():
    broken = []
    for path, text in PAGES.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # http://, https://, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                broken.append(f"{path.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _heading_anchors(linked.read_text()):
                broken.append(f"{path.name}: {target} (no such heading)")
    assert broken == []


def test_settings_table_lists_every_setting_exactly_once():
    rows = re.findall(r"^\| `(\w+)` \|", (DOCS / "settings.md").read_text(), flags=re.MULTILINE)
    assert sorted(rows) == sorted(field_names())


def test_the_commands_were_found():
    """The parsing below sees the commands the pages show (else the other tests would pass on nothing)."""
    shown = {" ".join(words[:3]) for _, words in ALL_COMMANDS}
    assert {"make demo", "make test", "airflow dags trigger", "docker compose -f"} <= shown


def test_every_make_target_named_exists():
    targets = {word for _, words in ALL_COMMANDS if words[0] == "make" for word in words[1:]
               if "=" not in word and not word.startswith("-")}
    assert {"demo", "test"} <= targets
    for target in sorted(targets):
        dry = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True, check=False)
        assert dry.returncode == 0, f"`make {target}` from the docs fails: {dry.stderr}"


def _airflow_arguments(words: list[str]) -> list[str] | None:
    """What follows `airflow`, run directly or in a compose service (`docker compose ... exec <service> airflow`)."""
    if words[0] == "airflow":
        return words[1:]
    if words[:2] == ["docker", "compose"] and "exec" in words:
        in_service = words[words.index("exec") + 2:]
        return in_service[1:] if in_service[:1] == ["airflow"] else None
    return None


def test_airflow_commands_are_subcommands_of_this_airflow():
    """Checked against Airflow's own CLI definitions (and the Celery provider's), without starting Airflow."""
    from airflow.cli.cli_config import GroupCommand, core_commands
    from airflow.providers.celery.cli.definition import get_celery_cli_commands

    commands = {command.name: command for command in [*core_commands, *get_celery_cli_commands()]}
    dags_file = (REPO / "dags" / "gpt_finetune.py").read_text()
    invocations = [(path, arguments) for path, words in ALL_COMMANDS
                   if (arguments := _airflow_arguments(words)) is not None]
    assert len(invocations) >= 5
    for path, (group, *rest) in invocations:
        assert group in commands, f"{path}: `airflow {group}` is no Airflow command"
        if isinstance(commands[group], GroupCommand):
            names = {sub.name for sub in commands[group].subcommands}
            assert rest and rest[0] in names, f"{path}: `airflow {group} {rest[:1]}`: not one of {sorted(names)}"
            if group == "dags" and rest[0] in ("trigger", "test") and len(rest) > 1:  # running text may omit the id
                assert f"\ndef {rest[1]}():" in dags_file, f"{path}: no DAG {rest[1]!r} in dags/"


def _conf_values(words: list[str]) -> list[str]:
    """The JSON given to `--conf`, also inside `make demo DEMO_ARGS=...`."""
    values = [words[i + 1] for i, word in enumerate(words[:-1]) if word == "--conf"]
    for word in words:
        if word.startswith(("DEMO_ARGS=", "--conf=")):
            values += _conf_values(shlex.split(word.split("=", 1)[1]))
    return values


def test_run_settings_in_shell_blocks_are_valid(monkeypatch):
    """Every `--conf` JSON parses and is a valid RunConfig under the operator's default policy (any bucket, the
    repository's data/ and the storage root) with the allow-lists that docs/security.md's example operator sets."""
    monkeypatch.delenv("GPT_FINETUNE_DATA_ROOTS", raising=False)
    monkeypatch.delenv("GPT_FINETUNE_S3_BUCKETS", raising=False)
    example = re.search(r"^## What a trigger user can reach\n.*?^```text\n(.*?)^```", PAGES[DOCS / "security.md"],
                        flags=re.MULTILINE | re.DOTALL)
    for _, variable, _ in ALLOW_LISTS.values():
        monkeypatch.delenv(variable, raising=False)
    for line in example.group(1).splitlines():
        variable, entries = line.split("=", 1)
        monkeypatch.setenv(variable, entries)
    confs = [(path, conf) for path, words in BLOCK_COMMANDS for conf in _conf_values(words)]
    assert len(confs) >= 4
    for path, conf in confs:
        try:
            RunConfig.from_params(json.loads(conf))
        except (ValueError, ConfigError) as error:  # json.JSONDecodeError is a ValueError
            pytest.fail(f"{path}: --conf {conf}: {error}")
    for path, words in BLOCK_COMMANDS:
        if "--conn-json" in words:
            assert "conn_type" in json.loads(words[words.index("--conn-json") + 1]), path


def test_python_modules_named_can_be_imported():
    modules = {words[i + 1] for _, words in ALL_COMMANDS for i, word in enumerate(words[:-1])
               if word == "-m" and i and Path(words[i - 1]).name.startswith("python")}
    assert {"bench.gpu_check", "trainer.preflight"} <= modules
    named = {module for module in modules if not module.startswith("<")}  # `python -m <module>` names none
    assert {module for module in named if importlib.util.find_spec(module) is None} == set()


def test_repository_files_named_in_commands_exist():
    missing = []
    for path, words in ALL_COMMANDS:
        arguments = words[1:-1] if words[0] == "cp" else words  # cp's last argument is what it creates
        for word in arguments:
            if word.startswith(tuple(f"{folder}/" for folder in REPO_FOLDERS)) and not list(REPO.glob(word)):
                missing.append(f"{path}: {word}")
    assert missing == []


def test_compose_services_and_uv_extras_named_exist():
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for path, words in ALL_COMMANDS:
        if words[:2] == ["uv", "sync"]:
            named = {words[i + 1] for i, word in enumerate(words[:-1]) if word == "--extra"}
            assert named <= extras, f"{path}: `uv sync --extra {named - extras}`: not in pyproject.toml"
        if words[:2] == ["docker", "compose"] and "exec" in words:
            files = [words[i + 1] for i, word in enumerate(words[:-1]) if word == "-f"]
            services = {name for file in files for name in yaml.safe_load((REPO / file).read_text())["services"]}
            assert words[words.index("exec") + 1] in services, f"{path}: {' '.join(words)}"


def test_ci_runs_the_readme_test_command():
    assert "make test" in README
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_the_consumer_dag_in_the_docs_parses_and_schedules_on_the_model_asset(tmp_path):
    """The 3-line consumer DAG of docs/stages.md, with the imports the page names, is a valid DAG scheduled on the
    Asset that the promote task updates."""
    from airflow.dag_processing.dagbag import DagBag

    snippet = (DOCS / "stages.md").read_text().split("schedules on it (with")[1].split("```python\n")[1].split("```")[0]
    (tmp_path / "consumer.py").write_text(
        "from airflow.providers.standard.operators.bash import BashOperator\nfrom airflow.sdk import Asset, dag\n\n"
        + snippet + "\ndeploy_gpt_finetune_model()\n")
    bag = DagBag(dag_folder=str(tmp_path))
    assert bag.import_errors == {}
    (asset,) = bag.dags["deploy_gpt_finetune_model"].timetable.asset_condition.objects
    dags_file = (REPO / "dags" / "gpt_finetune.py").read_text()
    assert f'Asset(name="{asset.name}", uri="{asset.uri}")' in dags_file
