import pytest

from trainer.config import AccessPolicy, ConfigError, RunConfig
from trainer.layout import REPO_ROOT

DEMO_SETTINGS = [  # scripts/demo.py, the compose stack and settings like the docs' (tests/test_readme.py checks those)
    {},
    {"num_workers": 3},
    {"storage_root": "s3://gpt-finetune", "storage_conn_id": "minio_s3"},
    {"dataset": "data/sample/tempest_gut.txt", "model": "gpt2", "tokenizer": "gpt2"},
    {"dataset": "file://" + str(REPO_ROOT / "data" / "sample"), "model": "openai-community/gpt2"},
    {"dataset": "s3://gpt-finetune/corpus/*.jsonl", "model": "s3://gpt-finetune/runs/x/train/model",
     "tokenizer": "s3://gpt-finetune/runs/x/train/model"},
]


@pytest.fixture
def operator_policy(monkeypatch, tmp_path):
    """The defaults an operator gets: the repository's data/ and the storage root; a bucket allow-list."""
    monkeypatch.delenv("GPT_FINETUNE_DATA_ROOTS", raising=False)
    monkeypatch.setenv("GPT_FINETUNE_STORAGE_ROOT", str(tmp_path / "storage"))
    monkeypatch.setenv("GPT_FINETUNE_S3_BUCKETS", "gpt-finetune, shared-corpora")
    return tmp_path


@pytest.mark.parametrize("params", DEMO_SETTINGS)
def test_defaults_and_demo_settings_are_allowed(operator_policy, params):
    RunConfig.from_params({"storage_root": str(operator_policy / "storage"), **params})


@pytest.mark.parametrize(
    "params, fragments",
    [
        ({"model": "http://127.0.0.1:9/x"},
         ["'model'", "http://127.0.0.1:9/x", "scheme 'http', which is not allowed", "s3://"]),
        ({"tokenizer": "https://example.com/tok"}, ["'tokenizer'", "which is not allowed"]),
        ({"dataset": "ftp://host/corpus.txt"}, ["'dataset'", "which is not allowed"]),
        ({"dataset": "hf://datasets/x"}, ["'dataset'", "which is not allowed"]),
        ({"dataset": "/etc/passwd"}, ["'dataset' = '/etc/passwd'", "outside the allowed data roots",
                                      str(REPO_ROOT / "data"), "GPT_FINETUNE_DATA_ROOTS"]),
        ({"dataset": "file:///etc/passwd"}, ["'dataset'", "outside the allowed data roots"]),
        ({"dataset": "../../x"}, ["'dataset' = '../../x'", "'..'"]),
        ({"dataset": "data/../../etc/*.txt"}, ["'dataset'", "'..'"]),
        ({"model": "s3://gpt-finetune/../other/model"}, ["'model'", "'..'"]),
        ({"dataset": "~/.ssh/*"}, ["'dataset'", "outside the allowed data roots"]),
        ({"dataset": "s3://airflow-logs/*.txt"}, ["'dataset'", "bucket 'airflow-logs' is not allowed",
                                                  "['gpt-finetune', 'shared-corpora']", "GPT_FINETUNE_S3_BUCKETS"]),
        ({"storage_root": "s3://airflow-logs/x"}, ["'storage_root'", "bucket 'airflow-logs'"]),
        ({"storage_root": "/etc"}, ["'storage_root' = '/etc'", "outside the allowed data roots"]),
        ({"model": str(REPO_ROOT / "dags")}, ["'model'", "outside the allowed data roots"]),
        ({"storage_root": "s3:///nobucket"}, ["'storage_root'", "names no bucket"]),
    ],
)
def test_settings_that_reach_beyond_the_allowed_places_are_refused(operator_policy, params, fragments):
    with pytest.raises(ConfigError) as error:
        RunConfig.from_params({"storage_root": str(operator_policy / "storage"), **params})
    for fragment in fragments:
        assert fragment in str(error.value)


def test_a_symlink_out_of_a_data_root_is_refused(operator_policy):
    storage = operator_policy / "storage"
    storage.mkdir()
    (storage / "escape").symlink_to("/etc")
    with pytest.raises(ConfigError, match="outside the allowed data roots"):
        RunConfig.from_params({"storage_root": str(storage), "dataset": str(storage / "escape" / "*.conf")})


def test_configured_roots_replace_the_defaults_and_empty_bucket_list_allows_any(monkeypatch, tmp_path):
    monkeypatch.setenv("GPT_FINETUNE_DATA_ROOTS", f"{tmp_path}/corpora:{tmp_path}/runs")
    monkeypatch.setenv("GPT_FINETUNE_S3_BUCKETS", "")
    cfg = RunConfig.from_params({"dataset": f"{tmp_path}/corpora/*.txt", "storage_root": f"{tmp_path}/runs",
                                 "model": "s3://any/model"})
    assert cfg.dataset.endswith("corpora/*.txt")
    with pytest.raises(ConfigError, match="outside the allowed data roots"):
        RunConfig.from_params({"storage_root": f"{tmp_path}/runs"})  # the default dataset, data/sample, is not allowed


def test_a_saved_config_loads_where_the_access_policy_would_refuse_it(operator_policy, monkeypatch):
    """Later tasks and the workers load prepare's config with `from_saved`: another environment's policy (a pod's,
    an SSH host's: none, or another one) is not applied again; `from_params`, prepare's way in, applies it."""
    saved = RunConfig.from_params({"storage_root": str(operator_policy / "storage"),
                                   "dataset": "s3://shared-corpora/*.txt"}).to_dict()
    monkeypatch.setenv("GPT_FINETUNE_DATA_ROOTS", str(operator_policy / "elsewhere"))
    monkeypatch.setenv("GPT_FINETUNE_S3_BUCKETS", "other-team")
    with pytest.raises(ConfigError, match="'dataset' = 's3://shared-corpora/\\*.txt': bucket 'shared-corpora'"):
        RunConfig.from_params(saved)
    assert RunConfig.from_saved(saved).to_dict() == saved
    with pytest.raises(ConfigError, match="'num_workers' = 0 is out of range"):  # the config's own rules still hold
        RunConfig.from_saved({**saved, "num_workers": 0})


def test_a_policy_given_to_from_params_replaces_the_environments():
    policy = AccessPolicy(data_roots=(str(REPO_ROOT / "data"),), s3_buckets=frozenset({"corpora"}))
    assert RunConfig.from_params({"storage_root": "s3://corpora/runs"}, policy).storage_root == "s3://corpora/runs"
    with pytest.raises(ConfigError, match="'storage_root' = 'storage' is outside the allowed data roots"):
        RunConfig.from_params({}, policy)
