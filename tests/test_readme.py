"""The README stays current: its two commands exist, and its settings table lists every run setting."""

import re
import subprocess
from pathlib import Path

from trainer.config import field_names

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_settings_table_lists_every_setting_exactly_once():
    rows = re.findall(r"^\| `(\w+)` \|", README, flags=re.MULTILINE)
    assert sorted(rows) == sorted(field_names())


def test_readme_commands_are_make_targets():
    for target in re.findall(r"^make (\w[\w-]*)", README, flags=re.MULTILINE):
        dry = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True, check=False)
        assert dry.returncode == 0, f"`make {target}` from the README fails: {dry.stderr}"


def test_ci_runs_the_readme_test_command():
    assert "make test" in README
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_the_consumer_dag_in_the_readme_parses_and_schedules_on_the_model_asset(tmp_path):
    """The 3-line consumer DAG, with the imports the README names, is a valid DAG scheduled on the Asset that the
    promote task updates."""
    from airflow.dag_processing.dagbag import DagBag

    snippet = README.split("schedules on it (with")[1].split("```python\n")[1].split("```")[0]
    (tmp_path / "consumer.py").write_text(
        "from airflow.providers.standard.operators.bash import BashOperator\nfrom airflow.sdk import Asset, dag\n\n"
        + snippet + "\ndeploy_gpt_finetune_model()\n")
    bag = DagBag(dag_folder=str(tmp_path))
    assert bag.import_errors == {}
    (asset,) = bag.dags["deploy_gpt_finetune_model"].timetable.asset_condition.objects
    dags_file = (REPO / "dags" / "gpt_finetune.py").read_text()
    assert f'Asset(name="{asset.name}", uri="{asset.uri}")' in dags_file
