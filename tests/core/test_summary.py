"""summary.json as its readers take it (core/summary.py): checked, the file and the field named when it is not."""

import pytest

from core.summary import SummaryError, TrainSummary

SUMMARY = {"num_workers": 2, "global_batch_size": 16, "steps": 4, "tokens_seen": 4096, "wall_time_s": 3.0,
           "train_time_s": 2.0, "tokens_per_s": 2048.0, "final_loss": 5.0, "first_step_s": 0.5,
           "config": {"num_workers": 2}}


def test_a_summary_reads_its_fields_and_leaves_the_keys_it_does_not_model():
    summary = TrainSummary.from_json(SUMMARY, "s3://bucket/run/summary.json")
    assert (summary.steps, summary.final_loss, summary.mfu, summary.hardware) == (4, 5.0, None, {})
    assert summary.seconds_per_step == 0.5  # no steps_timed (an older summary): steps - resumed_from_step


@pytest.mark.parametrize(("summary", "named"), [
    ({key: value for key, value in SUMMARY.items() if key != "steps"}, "missing key(s) steps"),
    ({**SUMMARY, "steps": "4"}, "s3://bucket/run/summary.json: steps: expected int"),
    ({**SUMMARY, "hardware": ["gpu"]}, "s3://bucket/run/summary.json: hardware"),
    ({**SUMMARY, "final_loss": True}, "s3://bucket/run/summary.json: final_loss"),
    ([SUMMARY], "s3://bucket/run/summary.json: expected a JSON object"),
])
def test_a_summary_missing_or_mistyping_a_field_is_refused_naming_the_file_and_the_field(summary, named):
    with pytest.raises(SummaryError, match=named.replace("(", r"\(").replace(")", r"\)")):
        TrainSummary.from_json(summary, "s3://bucket/run/summary.json")
