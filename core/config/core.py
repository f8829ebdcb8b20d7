"""The core settings of a run: model, tokenizer, data, training, promotion and monitoring.

Each field's JSON type (checked by pydantic against its annotation), the bounds and choices its declaration
gives (`schema.setting`), and the rules between these settings. Nothing here reads the environment: the same
config gives the same answer everywhere.
"""

from __future__ import annotations

import functools
import re
import types
import typing
from collections.abc import Mapping
from email.utils import parseaddr
from typing import Annotated, Any
from urllib.parse import urlparse

from pydantic import AllowInfNan, ConfigDict, TypeAdapter, ValidationError

from core.config import schema


class ConfigError(ValueError):
    """A run setting is missing, unknown, of the wrong type or out of range."""


# Shapes of the random-init model presets; anything else in `model` is a hub id or a directory/URL
# in `save_pretrained` format.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 64, "n_positions": 256},
    "gpt2-124m": {"n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024},
    # A Llama-architecture decoder (trainer/decoders/llama.py): grouped-query attention, SwiGLU, a tied head.
    "tiny-llama": {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "hidden_size": 64, "intermediate_size": 176, "max_position_embeddings": 256,
                   "tie_word_embeddings": True},
}
assert tuple(MODEL_PRESETS) == schema.MODEL_PRESET_NAMES, "the trigger form names the presets (schema.py)"

# Serving exports of the trained model, each checked for parity before promotion (trainer/export.py).
EXPORT_FORMATS = schema.EXPORT_FORMATS
RETIRED_EXPORT_FORMAT = "tf_h5"  # tf_model.h5, written before the model became a safetensors checkpoint
# `model: "promoted"` continues from the latest promoted version of `model_name`, `promoted:<name>` from another.
PROMOTED_MODEL = "promoted"
_MODEL_NAME = re.compile(schema.MODEL_NAME)
STORAGE_SCHEMES = ("", "file", "s3")
MAX_GLOBAL_BATCH = 1 << 20
MAX_GRAD_ACCUM = schema.MAX_GRAD_ACCUM
EVAL_BATCH_SEQUENCES = 8  # sequences per evaluation batch (trainer/evaluate.py): `eval_tokens` asks for one at least
BPE_SPEC = re.compile(r"^bpe:(\d+)$")
_REVISION = re.compile(schema.REVISION)
_EMAIL = re.compile(schema.EMAIL)
_CONN_ID = re.compile(schema.CONN_ID)
_TEXT_COLUMN = re.compile(schema.TEXT_COLUMN)
_LORA_TARGET = re.compile(schema.LORA_TARGET)
# Remote model directories whose content the project never rewrites: a cached hub base (pinned to its commit sha)
# and a registry version.
_PINNED_REMOTE_MODEL = re.compile(r".*/models/(base/[^/]+@[0-9a-f]{40}|[^/]+/v\d+/model)/?")


# What a field of each annotation must be, for the message (with an example for --conf where quoting misleads).
_WANTED: dict[str, str] = {
    "int | None": "an integer or empty",
    "bool": "true or false",
    "int": 'an integer. In --conf write it without quotes, e.g. {{"{name}": 4}}',
    "float": "a finite number",
    "str": "a string",
    "tuple[str, ...]": 'a list of strings. In --conf write e.g. {{"{name}": ["host_a", "host_b"]}}',
    "Mapping[str, str]": 'a map of strings to strings, e.g. {{"{name}": {{"nvidia.com/gpu.product": "NVIDIA-H200"}}}}',
    "tuple[Mapping[str, Any], ...]": "a list of objects",
}


def _json_shape(annotation: Any) -> Any:
    """The annotation a JSON value of it is checked against: arrays where tuples are held, objects where read-only
    mappings are, finite numbers (pydantic's strict mode takes no list for a tuple, and no mapping proxy)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is tuple:
        return list[_json_shape(args[0])]  # type: ignore[misc]
    if origin is Mapping:
        return dict[args[0], _json_shape(args[1])]  # type: ignore[misc,valid-type]
    if origin in (typing.Union, types.UnionType):
        return typing.Union[tuple(_json_shape(arm) for arm in args)]  # noqa: UP007 (built from a tuple)
    return Annotated[float, AllowInfNan(False)] if annotation is float else annotation


@functools.cache
def _adapter(annotation: Any) -> TypeAdapter[Any]:
    return TypeAdapter(_json_shape(annotation), config=ConfigDict(strict=True))


def checked_value(name: str, value: Any, annotation: Any) -> Any:
    """`value` as the field `name` of type `annotation` holds it (ints are accepted where floats are expected, and
    become floats); ConfigError naming the setting, the value and what it must be otherwise."""
    try:
        return _adapter(annotation).validate_python(schema.thawed(value))
    except ValidationError:
        pass
    wanted, _, example = _WANTED[_spelled(annotation)].format(name=name).partition(". ")
    got = f"{value!r} ({type(value).__name__})"
    raise ConfigError(f"Setting '{name}' must be {wanted}, got {got}." + (f" {example}." if example else ""))


def _spelled(annotation: Any) -> str:
    return re.sub(r"\b(?:typing|collections\.abc)\.", "", str(annotation) if typing.get_args(annotation)
                  else annotation.__name__)


def check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"Setting '{name}' = {value!r} is not allowed: choose one of {list(allowed)}.")


def check_model_name(name: str, value: str, *, setting_value: str | None = None) -> None:
    if not _MODEL_NAME.fullmatch(value):
        raise ConfigError(
            f"Setting '{name}' = {setting_value or value!r} names the registered model {value!r}, which is not a "
            "safe name: use 1-64 letters, digits, '_' or '-', starting with a letter or digit."
        )


def _check_bounds(cfg: Any) -> None:
    settings = schema.declared(type(cfg))
    for name, (low, high) in schema.bounds(settings, "minimum").items():
        value = schema.value_of(cfg, name)
        if not low <= value <= high:
            raise ConfigError(f"Setting '{name}' = {value!r} is out of range: allowed is {low} to {high}.")
    for name, (low, high) in schema.bounds(settings, "exclusiveMinimum").items():
        value = schema.value_of(cfg, name)
        if not low < value <= high:
            raise ConfigError(f"Setting '{name}' = {value!r} is out of range: allowed is ({low:g}, {high:g}].")


def _check_lengths(cfg: Any) -> None:
    """First, so that no other rule reads (or quotes whole) a value longer than its setting allows."""
    for setting in schema.declared(type(cfg)):
        limit = setting.rules.get("maxLength") or setting.rules.get("items", {}).get("maxLength")
        if not limit:
            continue
        value = schema.value_of(cfg, setting.name)
        for text in value if isinstance(value, tuple) else (value,):
            if len(text) > limit:
                raise ConfigError(f"Setting '{setting.name}' has a value of {len(text)} characters ({text[:40]!r}...): "
                                  f"at most {limit} are allowed; shorten it.")


def _check_one_gpu_per_worker(cfg: Any) -> None:
    """Before the bounds, to say why and what instead: a pod with N GPUs makes N replicas of one worker, which
    training refuses ("each worker must drive exactly one device") only after the pods were scheduled."""
    gpus = cfg.launch.kubernetes.gpus_per_worker
    if gpus > 1:
        raise ConfigError(
            f"Setting 'gpus_per_worker' = {gpus} is not supported yet: one GPU per worker; run more "
            f"workers instead (setting 'num_workers', e.g. {cfg.num_workers * gpus} for the same "
            "GPUs) with 'gpus_per_worker' = 1, or 0 for one with 'use_gpu'.")


def is_email_address(value: Any) -> bool:
    """A plain address (`schema.EMAIL`) that the mail library reads back as itself."""
    return isinstance(value, str) and bool(_EMAIL.fullmatch(value)) and parseaddr(value)[1] == value


def _check_alerts(cfg: Any) -> None:
    """Recipients need a connection to send through and the other way round (the connection itself is looked up
    in prepare, where Airflow's connections are: tasks/alerts.py)."""
    alerts = cfg.monitoring
    if alerts.alert_conn_id and not _CONN_ID.fullmatch(alerts.alert_conn_id):
        raise ConfigError(f"Setting 'alert_conn_id' = {alerts.alert_conn_id!r} is not an Airflow connection id "
                          "(letters, digits, '_', '.', '-').")
    bad = [address for address in alerts.alert_emails if not is_email_address(address)]
    if bad:
        raise ConfigError(f"Setting 'alert_emails' has {bad}, which are not plain e-mail addresses: write "
                          "name@domain.tld with letters, digits and '._+-' before the '@', letters, digits, '-' and "
                          "dots after it (no comments, quotes, '%', '!' or [address]).")
    if alerts.alert_emails and not alerts.alert_conn_id:
        raise ConfigError("Setting 'alert_emails' needs 'alert_conn_id': the Airflow connection (smtp type) that "
                          "sends the alerts.")
    if alerts.alert_conn_id and not alerts.alert_emails:
        raise ConfigError(f"Setting 'alert_conn_id' = {alerts.alert_conn_id!r} needs 'alert_emails': the addresses "
                          "the alerts go to.")


def _check_reclaim(cfg: Any) -> None:
    """Reclaiming idle GPUs acts on the idle-held watch's verdict, which needs `max_idle_held_s` of evidence."""
    watch = cfg.monitoring
    if not watch.reclaim_idle_after_s:
        return
    if not watch.max_idle_held_s:
        raise ConfigError(f"Setting 'reclaim_idle_after_s' = {watch.reclaim_idle_after_s} needs the idle-held watch: "
                          "set 'max_idle_held_s' (its window) above 0 and at most reclaim_idle_after_s.")
    if watch.reclaim_idle_after_s < watch.max_idle_held_s:
        raise ConfigError(f"Setting 'reclaim_idle_after_s' = {watch.reclaim_idle_after_s} is below the idle-held "
                          f"watch's window 'max_idle_held_s' = {watch.max_idle_held_s}: a group is idle only after "
                          "that window; raise reclaim_idle_after_s to at least it, or lower max_idle_held_s.")


def check_core_settings(cfg: Any) -> None:
    """The bounds of a RunConfig's numeric settings, and the rules of its model, tokenizer, data, training,
    promotion and monitoring settings."""
    _check_lengths(cfg)
    _check_one_gpu_per_worker(cfg)
    _check_bounds(cfg)
    _check_alerts(cfg)
    _check_reclaim(cfg)
    for name in ("mixed_precision", "baseline", "promote", "capacity", "adapter", "base_weights_dtype"):
        check_choice(name, schema.value_of(cfg, name), schema.choices(type(cfg), name))
    check_model_name("model_name", cfg.promotion.model_name)
    _check_export_formats(cfg)
    _check_locations(cfg)
    _check_tokenizer(cfg)
    _check_training(cfg)
    _check_adapter(cfg)


def _check_export_formats(cfg: Any) -> None:
    if RETIRED_EXPORT_FORMAT in cfg.promotion.export_formats:
        raise ConfigError(f"Setting 'export_formats' names {RETIRED_EXPORT_FORMAT!r}, which is retired: the model "
                          "directory is now a Hugging Face checkpoint (model.safetensors), checked as 'safetensors'. "
                          f"Remove it: choose from {list(EXPORT_FORMATS)}.")
    unknown = [name for name in cfg.promotion.export_formats if name not in EXPORT_FORMATS]
    if unknown:
        raise ConfigError(f"Setting 'export_formats' has {unknown}, which are not export formats: choose from "
                          f"{list(EXPORT_FORMATS)}, or [] for the model directory alone without parity checks.")
    if len(set(cfg.promotion.export_formats)) != len(cfg.promotion.export_formats):
        raise ConfigError(f"Setting 'export_formats' = {list(cfg.promotion.export_formats)} names a format twice.")


def _check_locations(cfg: Any) -> None:
    for name in ("dataset", "text_column", "tokenizer", "model", "storage_root"):
        if not getattr(cfg, name).strip():
            raise ConfigError(f"Setting '{name}' must not be empty.")
    if not _TEXT_COLUMN.fullmatch(cfg.text_column):
        raise ConfigError(f"Setting 'text_column' = {cfg.text_column!r} is not a column name: use up to 128 letters, "
                          "digits, '_', '.', '-' and spaces, starting with a letter, digit or '_'.")

    scheme = urlparse(cfg.storage_root).scheme
    if scheme not in STORAGE_SCHEMES:
        raise ConfigError(
            f"Setting 'storage_root' = {cfg.storage_root!r} uses the unsupported scheme '{scheme}': "
            "use a local path, file:// or s3://."
        )
    if cfg.promoted_source is not None:
        check_model_name("model", cfg.promoted_source, setting_value=cfg.model)
    _check_model_revision(cfg)


def _check_model_revision(cfg: Any) -> None:
    """A revision pins a hub model (prepare resolves it to a commit sha); a preset or a promoted version has none."""
    if cfg.promotion.model_name == "base":
        raise ConfigError("Setting 'model_name' = 'base' is reserved: storage_root/models/base/ holds the cached hub "
                          "models. Choose another name.")
    if not cfg.model_revision:
        return
    if cfg.model in MODEL_PRESETS or cfg.promoted_source is not None:
        raise ConfigError(f"Setting 'model_revision' = {cfg.model_revision!r} applies to a hub model name, not to "
                          f"'model' = {cfg.model!r}: leave it empty.")
    if not _REVISION.fullmatch(cfg.model_revision):
        raise ConfigError(f"Setting 'model_revision' = {cfg.model_revision!r} is no branch, tag or commit name: use "
                          "up to 255 letters, digits, '.', '_', '-' or '/'.")


def _check_tokenizer(cfg: Any) -> None:
    vocab = cfg.bpe_vocab_size
    if cfg.tokenizer.startswith("bpe:") and vocab is None:
        raise ConfigError(
            f"Setting 'tokenizer' = {cfg.tokenizer!r} is malformed: write bpe:<vocab size>, e.g. bpe:8192.")
    if vocab is not None and not 260 <= vocab <= 1_000_000:
        raise ConfigError(f"Setting 'tokenizer' = {cfg.tokenizer!r}: the BPE vocabulary must be 260 to 1000000.")


def _check_training(cfg: Any) -> None:
    preset = MODEL_PRESETS.get(cfg.model)
    positions = preset and (preset.get("n_positions") or preset["max_position_embeddings"])
    if preset and cfg.block_size > positions:
        raise ConfigError(
            f"Setting 'block_size' = {cfg.block_size} exceeds what model '{cfg.model}' allows "
            f"({positions} positions): lower 'block_size'."
        )
    if cfg.max_steps and cfg.warmup_steps >= cfg.max_steps:
        raise ConfigError(
            f"Setting 'warmup_steps' = {cfg.warmup_steps} must be below 'max_steps' = {cfg.max_steps}."
        )
    if cfg.global_batch_size > MAX_GLOBAL_BATCH:
        raise ConfigError(
            f"Global batch = batch_size_per_worker x num_workers x grad_accum_steps = "
            f"{cfg.batch_size_per_worker} x {cfg.num_workers} x {cfg.grad_accum_steps} = {cfg.global_batch_size} "
            f"exceeds {MAX_GLOBAL_BATCH}: lower one of them."
        )
    if cfg.num_shards and cfg.num_shards < cfg.num_workers:
        raise ConfigError(
            f"Setting 'num_shards' = {cfg.num_shards} is below 'num_workers' = {cfg.num_workers}: every worker "
            "needs at least one shard of its own. Raise 'num_shards' or set it to 0 (automatic)."
        )
    _check_eval_tokens(cfg)
    if cfg.mixed_precision == "fp16" and not cfg.use_gpu:
        raise ConfigError("Setting 'mixed_precision' = 'fp16' needs 'use_gpu' = true: use 'bf16' or 'no' on CPU.")


def _check_eval_tokens(cfg: Any) -> None:
    """An evaluation sample of at least one batch; 0 evaluates the whole validation split."""
    batch_tokens = EVAL_BATCH_SEQUENCES * cfg.block_size
    if 0 < cfg.eval_tokens < batch_tokens:
        raise ConfigError(
            f"Setting 'eval_tokens' = {cfg.eval_tokens} is below one evaluation batch ({EVAL_BATCH_SEQUENCES} "
            f"sequences x 'block_size' {cfg.block_size} = {batch_tokens} tokens): raise it to {batch_tokens} or "
            "more, or set 0 to evaluate the whole validation split.")


def _check_adapter(cfg: Any) -> None:
    """LoRA's settings, and a base model an adapter can name exactly (docs/adapters.md#which-base)."""
    if cfg.base_weights_dtype != "float32" and cfg.adapter != "lora":
        raise ConfigError(f"Setting 'base_weights_dtype' = {cfg.base_weights_dtype!r} needs 'adapter' = 'lora': "
                          "only frozen weights may be stored in bfloat16 (AdamW updates float32 weights). Set "
                          "'adapter' to 'lora' or 'base_weights_dtype' to 'float32'.")
    bad = [name for name in cfg.lora_targets if not _LORA_TARGET.fullmatch(name)]
    if bad:
        raise ConfigError(f"Setting 'lora_targets' has {bad}, which are not module names: write Hugging Face's "
                          "names, e.g. ['c_attn', 'c_fc'] for GPT-2 or ['q_proj', 'v_proj'] for Llama.")
    if len(set(cfg.lora_targets)) != len(cfg.lora_targets):
        raise ConfigError(f"Setting 'lora_targets' = {list(cfg.lora_targets)} names a module twice.")
    if cfg.adapter != "lora":
        return
    scheme = urlparse(cfg.model).scheme
    if scheme not in ("", "file") and not _PINNED_REMOTE_MODEL.fullmatch(cfg.model):
        raise ConfigError(
            f"Setting 'adapter' = 'lora' needs a pinned base model, but 'model' = {cfg.model!r} is a remote directory "
            "whose content may change under the adapter and that the project cannot fingerprint without reading it "
            "whole: use a hub name (prepare pins its commit sha), a promoted version, a preset, or a local copy of "
            "it (fingerprinted by content).")
