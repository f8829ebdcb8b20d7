"""The prepare stage's XCom documents (tasks/dataset/plan.py): the plan carries ids, numbers and the config once."""

import json

import pytest

from core.document import DocumentError
from tasks.dataset.plan import DatasetPlan, PreparedDataset

DATASET = PreparedDataset(manifest_url="/r/datasets/0123456789abcdef0123/manifest.json",
                          fingerprint="0123456789abcdef0123", cache_hit=True, train_sequences=10,
                          validation_sequences=2, train_tokens=640, tokenized_tokens=0, elapsed_s=0.5,
                          timings={}, source_bytes_read=0)


def test_a_plan_reads_back_as_written_with_its_dataset():
    plan = DatasetPlan(fingerprint=DATASET.fingerprint, manifest_url=DATASET.manifest_url, cache_hit=True,
                       config={"storage_root": "/r"}, dataset=DATASET)
    xcom = json.loads(json.dumps(plan.to_xcom()))
    assert DatasetPlan.from_xcom(xcom) == plan and "cfg" not in xcom


def test_a_prepared_dataset_of_another_shape_is_refused_by_name():
    xcom = DatasetPlan(fingerprint="f", manifest_url="m", cache_hit=True, config={}, dataset=DATASET).to_xcom()
    xcom["dataset"]["train_sequences"] = "10"
    with pytest.raises(DocumentError, match="PreparedDataset.train_sequences: expected int"):
        DatasetPlan.from_xcom(xcom)
