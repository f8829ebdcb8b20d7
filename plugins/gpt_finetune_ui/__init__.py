"""Airflow UI plugin: run reports (speedup, scaling efficiency, loss parity, charts) from object storage.

`ui_plugin.py` holds the AirflowPlugin; `reports_app.py` the routes of the FastAPI app it mounts, `runs_data.py`
what they read from storage and `report_pages.py` the HTML (a run's report from tasks/report/view.py, as report.md).
Airflow imports every file of the plugins folder as a top-level module named after the file, so no module uses
relative imports, none is named like a standard library module, and only `ui_plugin.py` defines a plugin class.
"""
