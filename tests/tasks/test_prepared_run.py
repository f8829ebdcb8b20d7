"""The prepared run (tasks/prepared_run.py): what publish writes is what later tasks read; nothing else is."""

from dataclasses import replace

import pytest

from core.document import DocumentError
from tasks.prepared_run import PreparedRun
from tasks.registry import PromotedVersion
from tests.tasks import run_fixtures


def test_a_prepared_run_reads_back_as_written_and_carries_the_config_once(tmp_path):
    continued = PromotedVersion(name="gpt_finetune", version="v1", url="s3://b/models/gpt_finetune/v1",
                                model_url="s3://b/models/gpt_finetune/v1/model", run_id="nightly__1", eval_loss=5.3)
    prepared = replace(run_fixtures.prepare_run(str(tmp_path), "manual__typed", num_workers=2),
                       continued_from=continued)
    xcom = prepared.to_xcom()
    assert PreparedRun.from_xcom(xcom) == prepared
    assert xcom["continued_from"] == {"name": "gpt_finetune", "version": "v1", "url": "s3://b/models/gpt_finetune/v1",
                                      "model_url": "s3://b/models/gpt_finetune/v1/model", "run_id": "nightly__1",
                                      "eval_loss": 5.3}  # the keys report.json's continued_from has
    assert prepared.config["num_workers"] == 2 and prepared.config["storage_root"] == str(tmp_path)
    assert not {"cfg", "storage_root", "total_steps", "preflight_url"} & set(xcom)  # no copies, no duplicates


@pytest.mark.parametrize(("change", "message"), [
    ({"preflight_url": "/etc"}, "unknown key(s) preflight_url"),
    ({"report_url": None}, "PreparedRun.report_url: expected str, got NoneType"),
    ({"manifest_sha256": None}, "PreparedRun.manifest_sha256: expected str, got NoneType"),  # the dataset's pin
    ({"config": "num_workers=64"}, "PreparedRun.config: expected"),
    ({"continued_from": ["v1"]}, "PreparedRun.continued_from: PromotedVersion: expected a JSON object, got list"),
    ({"continued_from": {"name": "m", "version": "v1", "url": "u", "model_url": "u/model", "run_id": "r",
                         "eval_loss": "5.3"}}, "PreparedRun.continued_from: PromotedVersion.eval_loss: expected float"),
])
def test_a_prepared_run_of_another_shape_in_xcom_is_refused(tmp_path, change, message):
    xcom = run_fixtures.prepare_run(str(tmp_path), "manual__shape").to_xcom()
    with pytest.raises(DocumentError) as refused:
        PreparedRun.from_xcom({**xcom, **change})
    assert message in str(refused.value)
    with pytest.raises(DocumentError, match="missing key"):
        PreparedRun.from_xcom({name: value for name, value in xcom.items() if name != "run_key"})
