"""The trigger form of the real Airflow UI in a headless Chromium: Params render as a form, a run starts from it.

A user logs in to the SimpleAuthManager page, opens gpt_finetune's Trigger dialog, sets Workers to 3 and
triggers; the run must exist with that conf (UI, CLI and REST API agree), and the conf the form sends must be one
the trainer accepts. The run is then marked failed so it trains nothing. Screenshots land in test-artifacts/.
"""

from __future__ import annotations

import contextlib
import re
import time
import urllib.parse

import pytest

from core.config import RunConfig
from tests.support.airflow_stack import REPO, AirflowStack
from tests.support.browser import chromium

pytestmark = pytest.mark.timeout(420)  # stack start-up on a loaded 2-core machine included

DAG = "gpt_finetune"
ARTIFACTS = REPO / "test-artifacts"
# Param titles from dags/gpt_finetune.py, by the control the form renders for each Param type.
FORM_FIELDS = {"Workers": "spinbutton", "Launcher backend": "combobox", "Mixed precision": "combobox",
               "Use GPUs": "checkbox"}
TEARDOWNS = ("release", "outcome")
FINISHED = {"success", "failed", "skipped", "upstream_failed"}


def run_path(run_id: str) -> str:
    return f"/api/v2/dags/{DAG}/dagRuns/{urllib.parse.quote(run_id, safe='')}"


@pytest.fixture
def page():
    from playwright.sync_api import expect

    with chromium() as browser:
        # Tall enough that the whole trigger dialog (every Param) renders at once for the screenshot.
        page = browser.new_page(viewport={"width": 1280, "height": 4000})
        # A loaded 2-core machine renders a page in more than expect's default 5 s.
        page.set_default_timeout(30_000)
        expect.set_options(timeout=30_000)
        try:
            yield page
        finally:
            expect.set_options(timeout=5_000)


@contextlib.contextmanager
def page_kept_on_failure(page):
    """On failure, the page's HTML goes next to the screenshots: the UI's DOM is what selectors are checked against."""
    ARTIFACTS.mkdir(exist_ok=True)
    for stale in ARTIFACTS.glob("ui_trigger_*"):
        stale.unlink()
    try:
        yield
    except Exception:
        (ARTIFACTS / "ui_trigger_failure.html").write_text(page.content())
        page.screenshot(path=str(ARTIFACTS / "ui_trigger_failure.png"))
        raise


def test_trigger_form_renders_params_and_starts_a_run_with_the_chosen_workers(airflow_stack, page):
    airflow_stack.wait_for_dag(DAG)
    with page_kept_on_failure(page):
        run_id = submit_the_form(airflow_stack, page)
        try:
            show_the_run(page, run_id)
            check_the_run(airflow_stack, run_id)
        finally:
            stop_the_run(airflow_stack, run_id)


def submit_the_form(airflow_stack: AirflowStack, page) -> str:
    """Log in, check the Params form, set Workers to 3, trigger; returns the new run's id."""
    from playwright.sync_api import expect

    user, password = airflow_stack.login
    page.goto(f"{airflow_stack.url}/dags/{DAG}")
    page.get_by_label("Username").fill(user)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"**/dags/{DAG}")

    page.get_by_role("button", name="Trigger Dag", exact=True).click()
    dialog = page.get_by_role("dialog").filter(has=page.get_by_role("heading", name=f"Trigger Dag - {DAG}"))
    expect(dialog.get_by_text("Run Parameters", exact=True)).to_be_visible()
    controls = {title: page.get_by_role(role, name=title, exact=True) for title, role in FORM_FIELDS.items()}
    rows = {title: dialog.get_by_role("group").filter(has=control) for title, control in controls.items()}
    for control in controls.values():
        expect(control).to_be_visible()
    expect(controls["Workers"]).to_have_value("2")
    expect(controls["Use GPUs"]).not_to_be_checked()
    expect(rows["Launcher backend"]).to_contain_text(re.compile(r"^Launcher backend\W*local"))  # the enum's choice
    expect(rows["Mixed precision"]).to_contain_text(re.compile(r"^Mixed precision\W*no"))
    expect(dialog.get_by_text("Data-parallel workers (one GPU each when use_gpu is on).")).to_be_visible()

    controls["Workers"].fill("3")
    submit = dialog.get_by_role("button", name="Trigger", exact=True)
    expect(submit, "the form refuses its own defaults: a Param whose default is empty needs "
                   "type=['null', ...] in dags/gpt_finetune.py").to_be_enabled()
    form = dialog.bounding_box()
    last_field = rows["Use GPUs"].bounding_box()
    page.screenshot(path=str(ARTIFACTS / "ui_trigger_form.png"),
                    clip={**form, "height": last_field["y"] + last_field["height"] - form["y"] + 16})

    submit.click()
    page.wait_for_url(re.compile(rf"/dags/{DAG}/runs/manual__"))
    return urllib.parse.unquote(page.url.rsplit("/runs/", 1)[1])


def show_the_run(page, run_id: str) -> None:
    """The UI opens the new run; its Details tab names the UI as the trigger and shows the chosen conf."""
    from playwright.sync_api import expect

    expect(page.get_by_role("heading", name=run_id)).to_be_visible()
    page.set_viewport_size({"width": 1280, "height": 1100})
    page.get_by_role("link", name="Details", exact=True).click()
    triggered_by = page.locator("tr").filter(has=page.get_by_role("cell", name="Triggered By", exact=True))
    expect(triggered_by).to_have_text(re.compile(r"^Triggered By\s*ui$"))
    conf = page.locator("tr").filter(has=page.get_by_role("cell", name="Conf", exact=True))
    expect(conf).to_contain_text(re.compile(r'"num_workers":\s*3,'))
    conf.scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "ui_trigger_run.png"))


def check_the_run(airflow_stack: AirflowStack, run_id: str) -> None:
    assert run_id in [run["run_id"] for run in airflow_stack.cli_json("dags", "list-runs", DAG)]
    run = airflow_stack.rest("GET", run_path(run_id))
    assert (run["run_type"], run["triggered_by"], run["conf"]["num_workers"]) == ("manual", "ui", 3)
    assert RunConfig.from_params(run["conf"]).num_workers == 3  # the form's whole conf passes the trainer's checks


def stop_the_run(airflow_stack: AirflowStack, run_id: str, timeout: float = 60) -> None:
    """Mark the run failed, as the UI's button does, so that it trains nothing, and wait for its release.

    Airflow skips every task that has not started and fails the running ones, but leaves both teardowns to run:
    release cleans up and outcome keeps the run failed. A task whose start (queued -> running) commits while the
    run is being marked escapes the mark, so it is repeated until no task but the teardowns is left to run.
    """
    deadline = time.monotonic() + timeout
    while True:
        airflow_stack.rest("PATCH", run_path(run_id), {"state": "failed"})
        states = {task["task_id"]: task["state"]
                  for task in airflow_stack.rest("GET", f"{run_path(run_id)}/taskInstances")["task_instances"]}
        left = {task: state for task, state in states.items() if task not in TEARDOWNS and state not in FINISHED}
        if not left:
            break
        assert time.monotonic() < deadline, f"tasks of {run_id} still to run {timeout:.0f}s after marking it: {left}"
        time.sleep(2)
    assert states["train"] in ("skipped", "failed"), states
    assert airflow_stack.wait_for_run(DAG, run_id, timeout=180) == "failed"
    states = airflow_stack.task_states(DAG, run_id)
    assert states["release"] == "success" and states["outcome"] == "failed", states
