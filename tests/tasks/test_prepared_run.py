"""The prepared run (tasks/prepared_run.py): what publish writes is what later tasks read; nothing else is."""

import pytest

from launcher.document import DocumentError
from tasks.prepared_run import PreparedRun
from tests.tasks import run_fixtures


def test_a_prepared_run_reads_back_as_written_and_carries_the_config_once(tmp_path):
    prepared = run_fixtures.prepare_run(str(tmp_path), "manual__typed", num_workers=2)
    xcom = prepared.to_xcom()
    assert PreparedRun.from_xcom(xcom) == prepared
    assert prepared.config["num_workers"] == 2 and prepared.config["storage_root"] == str(tmp_path)
    assert not {"cfg", "storage_root", "total_steps", "preflight_url"} & set(xcom)  # no copies, no duplicates


@pytest.mark.parametrize(("change", "message"), [
    ({"preflight_url": "/etc"}, "unknown key(s) preflight_url"),
    ({"report_url": None}, "PreparedRun.report_url: expected str, got NoneType"),
    ({"config": "num_workers=64"}, "PreparedRun.config: expected"),
    ({"continued_from": ["v1"]}, "PreparedRun.continued_from: expected"),
])
def test_a_prepared_run_of_another_shape_in_xcom_is_refused(tmp_path, change, message):
    xcom = run_fixtures.prepare_run(str(tmp_path), "manual__shape").to_xcom()
    with pytest.raises(DocumentError) as refused:
        PreparedRun.from_xcom({**xcom, **change})
    assert message in str(refused.value)
    with pytest.raises(DocumentError, match="missing key"):
        PreparedRun.from_xcom({name: value for name, value in xcom.items() if name != "run_key"})
