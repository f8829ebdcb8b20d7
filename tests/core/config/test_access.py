
import re

import pytest

from core.config import AccessPolicy, ConfigError, RunConfig
from core.config.access import ALLOW_LISTS
from core.layout import REPO_ROOT

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
    """The defaults an operator gets: the repository's data/ and the storage root; a bucket allow-list and the
    compose stack's storage connection (docker/docker-compose.yaml); every other allow-list at its default."""
    monkeypatch.delenv("GPT_FINETUNE_DATA_ROOTS", raising=False)
    monkeypatch.setenv("GPT_FINETUNE_STORAGE_ROOT", str(tmp_path / "storage"))
    monkeypatch.setenv("GPT_FINETUNE_S3_BUCKETS", "gpt-finetune, shared-corpora")
    for _, variable, _ in ALLOW_LISTS.values():
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("GPT_FINETUNE_STORAGE_CONN_IDS", "minio_s3")
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
        RunConfig.from_params(RunConfig.from_saved(saved).settings())
    assert RunConfig.from_saved(saved).to_dict() == saved
    with pytest.raises(ConfigError, match="'num_workers' = 0 is out of range"):  # the config's own rules still hold
        RunConfig.from_saved({**saved, "num_workers": 0})


def test_a_policy_given_to_from_params_replaces_the_environments():
    policy = AccessPolicy(data_roots=(str(REPO_ROOT / "data"),), s3_buckets=frozenset({"corpora"}))
    assert RunConfig.from_params({"storage_root": "s3://corpora/runs"}, policy).storage_root == "s3://corpora/runs"
    with pytest.raises(ConfigError, match="'storage_root' = 'storage' is outside the allowed data roots"):
        RunConfig.from_params({}, policy)


# The review's reproduction (security_review_t4.md, section 2): pods of the user's image under a service account and
# in a namespace of the user's choosing, with any connection's login and password as storage keys.
ON_S3 = {"storage_root": "s3://gpt-finetune/x"}
KUBERNETES = {**ON_S3, "backend": "kubernetes"}
SSH = {**ON_S3, "backend": "ssh", "ssh_conn_ids": ["tfmw_ssh_host_0"]}
ALERTS = {**ON_S3, "alert_conn_id": "alerts_smtp", "alert_emails": ["ops@example.com"]}


@pytest.mark.parametrize("params, fragments", [
    ({**KUBERNETES, "image": "attacker.example/evil:latest"},
     ["'image' = 'attacker.example/evil:latest'", "GPT_FINETUNE_IMAGE_PREFIXES=gpt-finetune-trainer:"]),
    ({**KUBERNETES, "service_account": "cluster-admin"},
     ["'service_account' = 'cluster-admin'", "GPT_FINETUNE_SERVICE_ACCOUNTS=(none)"]),
    ({**KUBERNETES, "namespace": "attacker-team"},
     ["'namespace' = 'attacker-team'", "GPT_FINETUNE_NAMESPACES=default"]),
    ({**KUBERNETES, "kubernetes_conn_id": "other_cluster"},
     ["'kubernetes_conn_id' = 'other_cluster'", "GPT_FINETUNE_KUBERNETES_CONN_IDS"]),
    ({**ON_S3, "storage_conn_id": "metadata_db"},
     ["'storage_conn_id' = 'metadata_db'", "GPT_FINETUNE_STORAGE_CONN_IDS=minio_s3"]),
    ({**SSH, "ssh_conn_ids": ["other_team_gpu"]},
     ["'ssh_conn_ids' has 'other_team_gpu'", "GPT_FINETUNE_SSH_CONN_IDS=(none)"]),
    ({**ALERTS, "alert_conn_id": "other_smtp"}, ["'alert_conn_id' = 'other_smtp'", "GPT_FINETUNE_ALERT_CONN_IDS"]),
])
def test_execution_and_credential_settings_outside_the_defaults_are_refused_by_name(operator_policy, params,
                                                                                    fragments):
    """Each allow-list defaults to the deployment's own value, never to anything."""
    with pytest.raises(ConfigError) as error:
        RunConfig.from_params(params)
    message = str(error.value)
    assert "outside the" in message and "this deployment allows" in message
    for fragment in fragments:
        assert fragment in message


def test_alert_recipients_outside_the_allowed_domains_are_refused(operator_policy, monkeypatch):
    monkeypatch.setenv("GPT_FINETUNE_ALERT_CONN_IDS", "alerts_smtp")
    monkeypatch.setenv("GPT_FINETUNE_ALERT_DOMAINS", "example.com, *.example.org")
    allowed = ["ops@example.com", "ML@Example.COM", "a@ml.example.org"]
    assert RunConfig.from_params({**ALERTS, "alert_emails": allowed}).monitoring.alert_emails == tuple(allowed)
    for address in ("x@attacker.example", "x@example.com.attacker.example", "x@example.org"):
        with pytest.raises(ConfigError, match=rf"'alert_emails' has '{address}', which is outside the recipient "
                                              r"domains this deployment allows \(GPT_FINETUNE_ALERT_DOMAINS="
                                              r"example.com,\*.example.org\)"):
            RunConfig.from_params({**ALERTS, "alert_emails": ["ops@example.com", address]})


def test_operator_lists_take_exact_values_patterns_and_image_prefixes_at_a_boundary(operator_policy, monkeypatch):
    monkeypatch.setenv("GPT_FINETUNE_IMAGE_PREFIXES", "registry.example.com/ml, gpt-finetune-trainer:")
    monkeypatch.setenv("GPT_FINETUNE_NAMESPACES", "ml-team")
    monkeypatch.setenv("GPT_FINETUNE_SERVICE_ACCOUNTS", "trainer")
    monkeypatch.setenv("GPT_FINETUNE_SSH_CONN_IDS", "tfmw_ssh_*")
    monkeypatch.setenv("GPT_FINETUNE_REMOTE_PYTHONS", "/opt/*/bin/python")
    pods = {**KUBERNETES, "namespace": "ml-team", "service_account": "trainer"}
    for image in ("registry.example.com/ml/trainer:1", "registry.example.com/ml:2", "gpt-finetune-trainer:dev"):
        assert RunConfig.from_params({**pods, "image": image}).launch.kubernetes.image == image
    for image in ("registry.example.com/ml-other/trainer:1", "registry.example.com/mlx", "gpt-finetune-trainer-x:1"):
        with pytest.raises(ConfigError, match=f"'image' = '{image}' is outside the images"):
            RunConfig.from_params({**pods, "image": image})
    with pytest.raises(ConfigError, match="'namespace' = 'default' is outside"):  # the list replaces the default
        RunConfig.from_params({**pods, "namespace": "default"})
    hosts = {**SSH, "ssh_conn_ids": ["tfmw_ssh_a", "tfmw_ssh_b"], "remote_python": "/opt/venv/bin/python"}
    assert RunConfig.from_params(hosts).launch.ssh.ssh_conn_ids == ("tfmw_ssh_a", "tfmw_ssh_b")
    with pytest.raises(ConfigError, match="'remote_python' = '/tmp/any/python' is outside the remote interpreters "
                                          r"this deployment allows \(GPT_FINETUNE_REMOTE_PYTHONS=/opt/\*/bin/python\)"):
        RunConfig.from_params({**hosts, "remote_python": "/tmp/any/python"})
    with pytest.raises(ConfigError, match="'remote_python' = '/opt/../tmp/bin/python' contains '..'"):
        RunConfig.from_params({**hosts, "remote_python": "/opt/../tmp/bin/python"})


def test_the_defaults_are_the_deployment_s_own_values_and_a_backend_s_settings_count_only_when_used(
        operator_policy):
    """Unset variables give the lists' defaults, which hold RunConfig's defaults; empty settings name nothing and
    pass. The Kubernetes and SSH settings of a run on another backend are never read, so an operator's narrower lists
    do not refuse them."""
    policy = AccessPolicy.from_env({})
    assert policy == AccessPolicy(policy.data_roots, frozenset())
    defaults = RunConfig().settings()
    assert defaults["image"].startswith(policy.image_prefixes[0]) and (defaults["namespace"],) == policy.namespaces
    RunConfig.from_params(KUBERNETES)  # every default, on the backend that reads the most of them
    RunConfig.from_params({**ON_S3, "namespace": "attacker-team", "image": "attacker.example/evil:latest"})


def test_a_wildcard_alert_domain_matches_a_suffix_only_and_refuses_the_reviews_comment_address(operator_policy,
                                                                                               monkeypatch):
    """Review t5, finding 3: `*.example.org` matched `a@evil.com(.example.org`, which smtplib sends to evil.com."""
    policy = AccessPolicy.from_env({"GPT_FINETUNE_ALERT_DOMAINS": "*.example.org,example.com"})
    for address in ("a@ml.example.org", "a@x.y.example.org", "a@Example.COM"):
        policy.check_allowed("alert_emails", address)
    for address in ("a@evil.com(.example.org", "a@example.org", "a@evilexample.org", "a@[127.0.0.1].example.org",
                    "a@example.com.evil.com", "a@xexample.com"):
        with pytest.raises(ConfigError, match="outside the recipient domains this deployment allows "
                                              r"\(GPT_FINETUNE_ALERT_DOMAINS=\*.example.org,example.com\)"):
            policy.check_allowed("alert_emails", address)


def test_an_image_entry_ending_in_a_colon_refuses_a_registry_port_and_admits_a_tag_only(operator_policy):
    """Review t5, finding 9: `gpt-finetune-trainer:` admitted `gpt-finetune-trainer:5000/attacker/trainer:latest`,
    which runtimes read as the registry `gpt-finetune-trainer:5000`."""
    for image in ("gpt-finetune-trainer:2.21.0", "gpt-finetune-trainer:dev_1"):
        assert RunConfig.from_params({**KUBERNETES, "image": image}).launch.kubernetes.image == image
    for image in ("gpt-finetune-trainer:5000/attacker/trainer:latest", "gpt-finetune-trainer:", 
                  "gpt-finetune-trainer:.x", "gpt-finetune-trainer:1@sha256:" + "0" * 64):
        with pytest.raises(ConfigError, match=rf"'image' = '{re.escape(image)}' is outside the images this "
                                              r"deployment allows \(GPT_FINETUNE_IMAGE_PREFIXES="):
            RunConfig.from_params({**KUBERNETES, "image": image})


@pytest.mark.parametrize("workdir, fragment", [
    ("/etc/cron.d", ("'remote_workdir' = '/etc/cron.d' is outside the remote work directories this deployment "
                     "allows (GPT_FINETUNE_REMOTE_WORKDIRS=(none))")),
    ("~/../../root/.ssh", "'remote_workdir' = '~/../../root/.ssh' contains '..'"),
])
def test_a_remote_workdir_off_the_allow_list_is_refused(operator_policy, monkeypatch, workdir, fragment):
    """Review t5, finding 10: the agent creates directories and the workers write wherever remote_workdir says."""
    monkeypatch.setenv("GPT_FINETUNE_SSH_CONN_IDS", "tfmw_ssh_*")
    with pytest.raises(ConfigError) as refused:
        RunConfig.from_params({**SSH, "remote_workdir": workdir})
    assert fragment in str(refused.value)


def test_the_operator_lists_remote_workdirs_and_an_empty_one_is_the_hosts_temporary_directory(operator_policy,
                                                                                             monkeypatch):
    monkeypatch.setenv("GPT_FINETUNE_REMOTE_WORKDIRS", "/scratch/tfmw/*")
    monkeypatch.setenv("GPT_FINETUNE_SSH_CONN_IDS", "tfmw_ssh_*")
    assert RunConfig.from_params({**SSH, "remote_workdir": "/scratch/tfmw/team-a"}).launch.ssh.remote_workdir
    assert RunConfig.from_params(SSH).launch.ssh.remote_workdir == ""
    with pytest.raises(ConfigError, match=r"GPT_FINETUNE_REMOTE_WORKDIRS=/scratch/tfmw/\*"):
        RunConfig.from_params({**SSH, "remote_workdir": "/scratch/other"})
    RunConfig.from_params({**ON_S3, "remote_workdir": "/etc/cron.d"})  # another backend never reads it


@pytest.mark.parametrize("params, fragment", [
    ({**ON_S3, "bpe_sample_mb": 1 << 20}, ("'bpe_sample_mb' = 1048576 is outside what this deployment allows "
                                          "(GPT_FINETUNE_MAX_BPE_SAMPLE_MB=1024): use a value at most 1024")),
    ({**ON_S3, "hang_timeout_s": 7 * 86_400, "max_idle_held_s": 0},
     "'hang_timeout_s' = 604800 is outside what this deployment allows (GPT_FINETUNE_MAX_HANG_TIMEOUT_S=21600)"),
    ({**KUBERNETES, "tolerations": [{"key": "k", "operator": "Exists", "effect": "NoExecute",
                                     "tolerationSeconds": 10**30}]},
     f"'tolerationSeconds' = {10**30} is outside what this deployment allows (GPT_FINETUNE_MAX_TOLERATION_S=3600)"),
])
def test_settings_above_the_operators_ceilings_are_refused_naming_the_variable(operator_policy, params, fragment):
    """Review t5, finding 10: a 1 TiB BPE sample, a 7-day hang watchdog and tolerationSeconds 10^30 were accepted."""
    with pytest.raises(ConfigError) as refused:
        RunConfig.from_params(params)
    assert fragment in str(refused.value) and "have the operator raise $GPT_FINETUNE_MAX_" in str(refused.value)


def test_the_operators_cost_ceiling_refuses_a_run_without_a_budget_or_above_it(operator_policy, monkeypatch):
    """The cost gate on the operator's side: the run's budget may be lower, never off or higher."""
    monkeypatch.setenv("GPT_FINETUNE_MAX_RUN_COST", "250")
    assert RunConfig.from_params({**ON_S3, "max_run_cost": 100}).monitoring.max_run_cost == 100
    for budget, fragment in ((0, "'max_run_cost' = 0 is outside what this deployment allows (0 turns the budget off"),
                             (1000, "'max_run_cost' = 1000 is outside what this deployment allows")):
        with pytest.raises(ConfigError, match=re.escape(fragment) + r".*GPT_FINETUNE_MAX_RUN_COST=250\): use a value "
                                                                    r"above 0 and at most 250"):
            RunConfig.from_params({**ON_S3, "max_run_cost": budget})
    monkeypatch.setenv("GPT_FINETUNE_MAX_HANG_TIMEOUT_S", "soon")
    with pytest.raises(ConfigError, match=r"\$GPT_FINETUNE_MAX_HANG_TIMEOUT_S = 'soon' is not a ceiling: set a "
                                          r"positive number, or unset it for the default \(21600\)"):
        RunConfig.from_params(ON_S3)
