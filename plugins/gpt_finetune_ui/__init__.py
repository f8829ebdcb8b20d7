"""Airflow UI plugin: run reports (speedup, scaling efficiency, loss parity, charts) from object storage.

`ui_plugin.py` holds the AirflowPlugin; `reports_app.py` the FastAPI app it mounts. Airflow imports every file of
the plugins folder as a top-level module named after the file, so neither module uses relative imports and only
`ui_plugin.py` defines a plugin class.
"""
