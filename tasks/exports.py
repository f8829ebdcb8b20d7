"""The promote task's view of a run's serving exports (trainer/export.py): their gate rows, their copy into the
promoted version, and their part of the model card.

Every format of the run's `export_formats` must have passed its parity check in the training output's
`exports/exports.json`; a format that failed, or a record that is missing (training did not finish its exports),
adds a failed gate row naming the format, and a run with a failed gate is never promoted. A promoted version's
`model/` is the run's Hugging Face checkpoint, which the `safetensors` format checked; every other format has a
folder of its own beside it (`saved_model/`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from core.config import RunConfig
from core.layout import TrainOutput, VersionLayout
from core.storage import exists, join, read_json
from tasks.report.document import ExportPart, Gate
from trainer.export import FORMAT_DIRS

if TYPE_CHECKING:
    from tasks.registry import VersionFile

GATE_PREFIX = "export_"


class ForeignModelError(RuntimeError):
    """The run's report or exports record names a model folder other than the run's own: nothing is copied."""


# The folder of each format in a promoted version (safetensors: the version's model/, copied with the version).
VERSION_DIRS = {"safetensors": "model", "saved_model": "saved_model"}
MODEL_FOLDER = VERSION_DIRS["safetensors"]


def read_record(output: TrainOutput) -> tuple[str, dict[str, Any] | None]:
    """exports.json of `output` (None when missing), each format's folder checked: its format's own
    (`trainer.export.FORMAT_DIRS`). Whoever writes storage could otherwise have any folder the Airflow worker can
    read copied into the registry; ForeignModelError names the format, the folder and the one it must be."""
    url = output.exports_record
    record = read_json(url) if exists(url) else None
    formats = (record or {}).get("formats") or {}
    for name, result in formats.items() if isinstance(formats, dict) else ():
        folder = result.get("dir") if isinstance(result, dict) else result
        if name not in FORMAT_DIRS or folder != FORMAT_DIRS[name]:
            raise ForeignModelError(
                f"{url}: formats.{name}.dir = {folder!r} is not that format's folder (it must be "
                f"{FORMAT_DIRS.get(name, 'a format of ' + ', '.join(FORMAT_DIRS))!r}): the record was rewritten after "
                "training wrote it, so nothing is promoted. Train again, or set 'export_formats' = [] to promote "
                "without exports.")
    return url, record


def gate_rows(cfg: RunConfig, url: str, record: dict[str, Any] | None) -> list[Gate]:
    """One gate per format of `export_formats`: passed when its parity check passed."""
    rows = []
    for name in cfg.promotion.export_formats:
        result = ((record or {}).get("formats") or {}).get(name)
        if result is None:
            missing = "is missing" if record is None else "lists no such format"
            rows.append(_row(name, False, None, None, f"export {name}: not written ({url} {missing}: training did "
                                                      "not finish its exports; see the train task's log)"))
            continue
        rows.append(_row(name, result.get("passed") is True, result.get("max_abs_diff"), result.get("tolerance"),
                         f"export {name}: {result.get('detail')}"))
    return rows


def _row(name: str, passed: bool, value: float | None, limit: float | None, detail: str) -> Gate:
    return Gate(name=f"{GATE_PREFIX}{name}", passed=passed, value=value, limit=limit, detail=detail)


def export_part(output: TrainOutput, cfg: RunConfig) -> ExportPart | None:
    """The serving exports' gates and parity record of the run's training output; None when `export_formats` is []
    (promotion.json then has neither)."""
    if not cfg.promotion.export_formats:
        return None
    url, record = read_record(output)
    return ExportPart(export_gates=tuple(gate_rows(cfg, url, record)), exports=record)


def copy_exports(part: ExportPart | None, output: TrainOutput, version: VersionLayout) -> list[VersionFile]:
    """Copy every exported format but the model directory itself (the version's model/, copied with it) from its own
    folder of the training output into the version; returns the files, relative to the version."""
    from tasks.registry import copy_into

    record = (part.exports if part else None) or {}
    files = []
    for name, result in sorted((record.get("formats") or {}).items()):
        if VERSION_DIRS.get(name, MODEL_FOLDER) == MODEL_FOLDER or not result.get("passed"):
            continue
        files += copy_into(version, VERSION_DIRS[name], join(output.url, FORMAT_DIRS[name]))
    return files


def card_lines(cfg: RunConfig, part: ExportPart | None) -> list[str]:
    """The model card's formats: each folder, its files, its parity figure and three lines that load it."""
    record = (part.exports if part else None) or {}
    formats = record.get("formats") or {}
    if not cfg.promotion.export_formats:
        return ["## Formats", "", _MODEL_ONLY, "", "```python", _LOADING["safetensors"].format(folder=MODEL_FOLDER),
                "```", ""]
    prompts = record.get("prompts") or {}
    lines = ["## Formats", "", _PARITY_NOTE.format(count=prompts.get("count"), tokens=prompts.get("tokens"),
                                                   tolerance=record.get("tolerance", 0)), ""]
    for name in [name for name in VERSION_DIRS if name in formats]:
        result = formats[name]
        folder = VERSION_DIRS[name]
        files = ", ".join(f"`{file['name']}`" for file in result.get("files", []))
        lines += [f"### `{folder}/`: {_TITLES[name]}", "",
                  f"- Parity: {'pass' if result.get('passed') else 'FAIL'}: {result.get('detail')}",
                  f"- Files: {files}", "", "```python", _LOADING[name].format(folder=folder), "```", ""]
    if "safetensors" not in formats:
        lines += [_MODEL_UNCHECKED, "", "```python", _LOADING["safetensors"].format(folder=MODEL_FOLDER), "```", ""]
    return lines


_MODEL_ONLY = ("Only `model/` (config.json, model.safetensors, generation_config.json and the tokenizer): setting "
               "`export_formats` = [] wrote no other format and checked no parity.")
_MODEL_UNCHECKED = ("`model/` (config.json, model.safetensors and the tokenizer) is there as always; its reload was "
                    "not checked (`safetensors` is not in `export_formats`).")
_PARITY_NOTE = ("Each format was read back and its logits compared with the trained model's on {count} prompts of "
                "{tokens} tokens from the validation split (float32; largest absolute difference at most "
                "{tolerance:.0e}, greedy tokens identical). Paths are relative to this version's folder.")
_TITLES = {"safetensors": "the model: config.json + model.safetensors for transformers 5 with PyTorch (vLLM, TGI) "
                          "and TensorFlow (`trainer.decoders.load_pretrained`; resuming, `model: promoted`)",
           "saved_model": "TensorFlow SavedModel, signature `serving_default` (TF Serving)"}
_LOADING = {
    "safetensors": """from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("{folder}")
tokenizer = AutoTokenizer.from_pretrained("{folder}")
# TensorFlow: from trainer.decoders.pretrained import load_pretrained; logits = load_pretrained("{folder}")(ids)""",
    "saved_model": """import tensorflow as tf
serve = tf.saved_model.load("{folder}").signatures["serving_default"]
logits = serve(input_ids=tf.constant([[0, 1]]), attention_mask=tf.constant([[1, 1]]))["logits"]""",
}
