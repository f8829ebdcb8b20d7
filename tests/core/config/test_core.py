import pytest

from core.config import MODEL_PRESETS, ConfigError, RunConfig


@pytest.mark.parametrize(
    "params, fragments",
    [
        ({"num_workers": 0}, ["'num_workers' = 0", "out of range", "1 to 64"]),
        ({"num_workers": 65}, ["'num_workers' = 65", "1 to 64"]),
        ({"prepare_tasks": 300}, ["'prepare_tasks' = 300", "0 to 256"]),
        ({"learning_rate": 0}, ["'learning_rate'", "(0, 1]"]),
        ({"batch_size_per_worker": 0}, ["'batch_size_per_worker' = 0", "out of range"]),
        ({"mixed_precision": "fp8"}, ["'mixed_precision' = 'fp8'", "'bf16'"]),
        ({"baseline": "maybe"}, ["'baseline'", "'auto'"]),
        ({"storage_root": "gs://bucket"}, ["'storage_root'", "scheme 'gs'"]),
        ({"tokenizer": "bpe:abc"}, ["'tokenizer'", "bpe:<vocab size>"]),
        ({"tokenizer": "bpe:100"}, ["'tokenizer'", "260 to 1000000"]),
        ({"model": "tiny", "block_size": 512}, ["'block_size' = 512", "'tiny'", "256 positions"]),
        ({"max_steps": 5, "warmup_steps": 5}, ["'warmup_steps' = 5", "'max_steps' = 5"]),
        ({"num_workers": 4, "num_shards": 2}, ["'num_shards' = 2", "'num_workers' = 4"]),
        ({"mixed_precision": "fp16"}, ["'fp16'", "use_gpu"]),
        ({"dataset": "  "}, ["'dataset'", "empty"]),
        ({"model_name": "../etc"}, ["'model_name' = '../etc'", "not a safe name", "letters, digits"]),
        ({"model_name": "a/b"}, ["'model_name' = 'a/b'", "not a safe name"]),
        ({"model_name": ""}, ["'model_name'", "not a safe name"]),
        ({"model": "promoted:.hidden"}, ["'model' = 'promoted:.hidden'", "'.hidden'", "not a safe name"]),
        ({"promotion_tolerance": -0.1}, ["'promotion_tolerance' = -0.1", "out of range", "0.0 to 100.0"]),
        ({"promote": "sometimes"}, ["'promote' = 'sometimes'", "'auto'", "'always'", "'never'"]),
        ({"eval_tokens": 511}, ["'eval_tokens' = 511", "below one evaluation batch", "8 sequences x 'block_size' 64",
                                "0 to evaluate the whole validation split"]),
        ({"eval_tokens": -1}, ["'eval_tokens' = -1", "out of range"]),
        (
            {"batch_size_per_worker": 4096, "num_workers": 64, "grad_accum_steps": 8},
            ["Global batch", "4096 x 64 x 8", "lower one of them"],
        ),
    ],
)
def test_bad_settings_name_key_value_and_what_is_allowed(params, fragments):
    with pytest.raises(ConfigError) as excinfo:
        RunConfig.from_params(params)
    message = str(excinfo.value)
    for fragment in fragments:
        assert fragment in message, message


def test_presets_fit_their_block_sizes():
    for name, preset in MODEL_PRESETS.items():
        positions = preset.get("n_positions") or preset["max_position_embeddings"]  # GPT-2's or Llama's key
        RunConfig.from_params({"model": name, "block_size": positions})
        with pytest.raises(ConfigError, match=f"exceeds what model '{name}' allows"):
            RunConfig.from_params({"model": name, "block_size": positions + 1})


@pytest.mark.parametrize("params, fragments", [
    ({"alert_emails": ["ops@example.com"]}, ["'alert_emails' needs 'alert_conn_id'", "smtp"]),
    ({"alert_conn_id": "alerts"}, ["'alert_conn_id' = 'alerts' needs 'alert_emails'"]),
    ({"alert_conn_id": "alerts", "alert_emails": ["ops"]}, ["'alert_emails' has ['ops']", "name@domain"]),
    # Review t5, finding 3: addresses a mail server reads another way than the domain check does.
    *[({"alert_conn_id": "alerts", "alert_emails": [address]}, [f"'alert_emails' has [{address!r}]", "plain e-mail",
                                                                "no comments, quotes, '%', '!' or [address]"])
      for address in ("a@evil.com(.example.org", "a%evil.com@example.com", "a@[127.0.0.1].example.org",
                      '"a@evil.com"@example.com', "a@example.com (x)", "evil.com!a@example.com",
                      "a@example.com,b@evil.com", "a@example")],
    ({"alert_conn_id": "alerts", "alert_emails": "ops@example.com"}, ["'alert_emails' must be a list of strings"]),
    ({"max_loss_rise": -1}, ["'max_loss_rise' = -1.0 is out of range", "0.0 to 100.0"]),
    ({"min_throughput_ratio": 1.5}, ["'min_throughput_ratio' = 1.5 is out of range", "0.0 to 1.0"]),
    ({"reclaim_idle_after_s": 600}, ["'reclaim_idle_after_s' = 600 is below the idle-held watch's window",
                                     "'max_idle_held_s' = 900"]),
    ({"reclaim_idle_after_s": 600, "max_idle_held_s": 0}, ["'reclaim_idle_after_s' = 600 needs the idle-held watch",
                                                           "'max_idle_held_s'"]),
], ids=["emails-without-connection", "connection-without-emails", "not-an-address",
        *[f"t5-3-not-plain-{i}" for i in range(8)], "emails-not-a-list",
        "negative-rise", "ratio-above-1", "reclaim-below-the-window", "reclaim-without-the-watch"])
def test_bad_monitoring_settings_are_refused_naming_the_setting(params, fragments):
    with pytest.raises(ConfigError) as raised:
        RunConfig.from_params(params)
    assert all(fragment in str(raised.value) for fragment in fragments), str(raised.value)


def test_reclaiming_idle_gpus_is_off_by_default_and_may_equal_the_watch_window():
    assert RunConfig.from_params({}).monitoring.reclaim_idle_after_s == 0
    cfg = RunConfig.from_params({"reclaim_idle_after_s": 900})
    assert cfg.monitoring.reclaim_idle_after_s == 900 and RunConfig.from_saved(cfg.to_dict()) == cfg


def test_alert_settings_round_trip_and_cleared_fields_mean_no_alerts():
    cfg = RunConfig.from_params({"alert_conn_id": "alerts", "alert_emails": ["ops@example.com", "a.b@ml.example.org"]})
    assert cfg.monitoring.alert_emails == ("ops@example.com", "a.b@ml.example.org")
    assert RunConfig.from_saved(cfg.to_dict()) == cfg
    cleared = RunConfig.from_params({"alert_conn_id": None, "alert_emails": None})  # the trigger form's empty fields
    assert (cleared.monitoring.alert_conn_id, cleared.monitoring.alert_emails) == ("", ())


def test_more_than_one_gpu_per_worker_is_refused_by_name():
    """A pod with 2 GPUs makes 2 replicas of one worker; training refuses that only after the pods were scheduled
    (trainer/train.py: "each worker must drive exactly one device")."""
    kubernetes = {"backend": "kubernetes", "storage_root": "s3://runs/x", "use_gpu": True, "num_workers": 4}
    with pytest.raises(ConfigError) as refused:
        RunConfig.from_params({**kubernetes, "gpus_per_worker": 2})
    assert str(refused.value).startswith(
        "Setting 'gpus_per_worker' = 2 is not supported yet: one GPU per worker; run more workers instead "
        "(setting 'num_workers', e.g. 8 for the same GPUs)"), str(refused.value)
    with pytest.raises(ConfigError, match="'gpus_per_worker' = 16 is not supported yet"):
        RunConfig.from_params({**kubernetes, "gpus_per_worker": 16})
    assert RunConfig.from_params({**kubernetes, "gpus_per_worker": 1}).launch.kubernetes.gpus_per_worker == 1


def test_eval_tokens_of_one_batch_or_zero_are_accepted():
    assert RunConfig(eval_tokens=512).eval_tokens == 512 and RunConfig(eval_tokens=0).eval_tokens == 0
    assert RunConfig(block_size=32, eval_tokens=256).eval_tokens == 256  # one batch of 8 x 32


def test_export_formats_are_checked_and_the_baseline_exports_nothing():
    cfg = RunConfig.from_params({})
    assert cfg.promotion.export_formats == ("safetensors", "saved_model")
    assert RunConfig.from_params({"export_formats": []}).promotion.export_formats == ()
    saved = RunConfig.from_params({"export_formats": ["saved_model"]}).to_dict()
    assert RunConfig.from_saved(saved).promotion.export_formats == ("saved_model",)
    with pytest.raises(ConfigError, match=r"'export_formats' has \['onnx'\], which are not export formats: choose "
                                          r"from \['safetensors', 'saved_model'\]"):
        RunConfig.from_params({"export_formats": ["safetensors", "onnx"]})
    with pytest.raises(ConfigError, match="names a format twice"):
        RunConfig.from_params({"export_formats": ["saved_model", "saved_model"]})
    with pytest.raises(ConfigError, match=r"'tf_h5', which is retired: the model directory is now a Hugging Face "
                                          r"checkpoint \(model.safetensors\), checked as 'safetensors'"):
        RunConfig.from_saved({**saved, "export_formats": ["safetensors", "tf_h5"]})
    with pytest.raises(ConfigError, match="'export_formats' must be a list of strings"):
        RunConfig.from_params({"export_formats": "safetensors"})
    assert cfg.baseline_config().promotion.export_formats == ()  # only the run's own model is promoted


def test_model_revision_pins_only_a_hub_model_and_base_is_no_model_name():
    assert RunConfig.from_params({"model": "gpt2", "model_revision": "v1.0"}).model_revision == "v1.0"
    assert RunConfig.from_params({"model": "gpt2", "model_revision": None}).model_revision == ""
    for model in ("tiny", "promoted"):
        with pytest.raises(ConfigError, match=f"'model_revision' = 'main' applies to a hub model name, not to "
                                              f"'model' = '{model}'"):
            RunConfig.from_params({"model": model, "model_revision": "main"})
    with pytest.raises(ConfigError, match="'model_revision' = 'main branch' is no branch, tag or commit name"):
        RunConfig.from_params({"model": "gpt2", "model_revision": "main branch"})
    with pytest.raises(ConfigError, match="'model_name' = 'base' is reserved"):
        RunConfig.from_params({"model_name": "base"})


@pytest.mark.parametrize("name, value, fragment", [
    ("text_column", "x" * (1 << 20), "'text_column' has a value of 1048576 characters ('xxxx"),
    ("dataset", "data/" + "d" * 5000, "'dataset' has a value of 5005 characters"),
    ("storage_conn_id", "c" * 300, "'storage_conn_id' has a value of 300 characters"),
])
def test_a_string_longer_than_its_setting_allows_is_refused_before_any_other_rule(name, value, fragment):
    """Review t5, finding 10: a 1 MB text_column was accepted."""
    with pytest.raises(ConfigError) as refused:
        RunConfig.from_params({name: value})
    assert fragment in str(refused.value) and "are allowed; shorten it" in str(refused.value)
    assert len(str(refused.value)) < 300  # the value is quoted in part, never whole


def test_a_text_column_with_markdown_or_html_is_refused():
    """Review t5, finding 8: a backtick in text_column ended the model card's code span and let HTML in."""
    injected = "text` <a href=\"https://evil.example/rotate-keys\">rotate your keys</a> <img src=x onerror=alert(1)> `"
    for value in (injected, "a|b", "a\nb", "<b>"):
        with pytest.raises(ConfigError, match=r"Setting 'text_column' = .* is not a column name: use up to 128"):
            RunConfig.from_params({"text_column": value})
    for value in ("text", "body", "Review Text", "meta.content", "col_2-a"):
        assert RunConfig.from_params({"text_column": value}).text_column == value


@pytest.mark.parametrize("params, fragments", [
    ({"base_weights_dtype": "bfloat16"}, ["'base_weights_dtype' = 'bfloat16' needs 'adapter' = 'lora'"]),
    ({"adapter": "lora", "lora_targets": ["c_attn", "c_attn"]}, ["'lora_targets'", "names a module twice"]),
    ({"adapter": "lora", "lora_targets": ["c-attn"]}, ["'lora_targets' has ['c-attn']", "not module names"]),
    ({"adapter": "lora", "model": "s3://bucket/team/gpt2-copy"},
     ["needs a pinned base model", "'s3://bucket/team/gpt2-copy'", "cannot fingerprint", "promoted version"]),
    ({"adapter": "adapter-v2"}, ["'adapter' = 'adapter-v2'", "'lora'"]),
])
def test_lora_settings_are_refused_by_name(params, fragments):
    with pytest.raises(ConfigError) as raised:
        RunConfig.of(**params)
    assert all(fragment in str(raised.value) for fragment in fragments), raised.value


def test_lora_accepts_pinned_bases():
    for model in ("tiny", "gpt2", "promoted", "/data/models/local-copy",
                  "s3://bucket/root/models/base/gpt2@" + "a" * 40, "s3://bucket/root/models/chat/v3/model"):
        cfg = RunConfig.of(adapter="lora", model=model, base_weights_dtype="bfloat16", recompute=True)
        assert (cfg.adapter, cfg.base_weights_dtype, cfg.recompute) == ("lora", "bfloat16", True)
