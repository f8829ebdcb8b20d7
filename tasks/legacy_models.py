"""Models saved before the model became a Hugging Face safetensors checkpoint (issue 50): a `model/` holding
transformers 4.57's `tf_model.h5` beside its config.json, in registry versions promoted then.

A run continuing from such a version (`model: promoted`) converts it once, in the prepare task: the h5 weights are
read with h5py (Keras' layout: the root's `layer_names`, each layer group's `weight_names`), renamed to PyTorch's
GPT-2 names, checked against the config's shapes and written beside them as model.safetensors, then
`converted_from_tf_model_h5.json` last; a version without that record is converted again (a killed conversion
leaves nothing that is read). Nothing the version's version.json lists is changed: the old config.json is kept
(transformers 5 and the decoder read it). A file that cannot be converted is refused naming the tensor and what to
do. Importable without TensorFlow. Any other such directory is converted the same way by hand:

    python -m tasks.legacy_models MODEL_DIR_OR_URL
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

from core import storage
from core.clock import utc_now
from trainer.decoders.architectures import CheckpointError, read_config
from trainer.decoders.gpt2_config import parameter_shapes
from trainer.decoders.safetensors_io import INDEX_FILE, WEIGHTS_FILE, write_file

LEGACY_WEIGHTS = "tf_model.h5"
CONVERTED_RECORD = "converted_from_tf_model_h5.json"
# transformers 4.57's TF GPT-2 weight names below its `transformer/` layer -> PyTorch's state-dict names.
_LAYER = re.compile(r"h_\._(\d+)/(.+)")
_KERAS_SUFFIX = {"gamma": "weight", "beta": "bias", "embeddings": "weight"}


def is_legacy_model(model_url: str) -> bool:
    """True for a model directory holding tf_model.h5 that was never converted (no safetensors record)."""
    return (storage.exists(storage.join(model_url, LEGACY_WEIGHTS))
            and not storage.exists(storage.join(model_url, CONVERTED_RECORD))
            and not storage.exists(storage.join(model_url, INDEX_FILE)))


def pytorch_name(tf_name: str) -> str | None:
    """`tfgpt2lm_head_model/transformer/h_._0/ln_1/gamma:0` -> `transformer.h.0.ln_1.weight`; None for a weight
    outside the `transformer/` layer."""
    scoped = tf_name.removesuffix(":0").split("/transformer/", 1)
    if len(scoped) != 2:
        return None
    path = scoped[1]
    layer = _LAYER.fullmatch(path)
    if layer:
        path = f"h/{layer.group(1)}/{layer.group(2)}"
    parts = path.split("/")
    parts[-1] = _KERAS_SUFFIX.get(parts[-1], parts[-1])
    return "transformer." + ".".join(parts)


def h5_tensors(path: Path, config, source: str) -> dict[str, np.ndarray]:
    """The weights of a TF GPT-2 tf_model.h5 under PyTorch's names and shapes (float32); CheckpointError naming a
    missing, extra or mis-shaped tensor."""
    import h5py

    expected = parameter_shapes(config)
    tensors: dict[str, np.ndarray] = {}
    with h5py.File(path, "r") as handle:
        for layer in handle.attrs.get("layer_names", []):
            group = handle[_text(layer)]
            for weight in group.attrs.get("weight_names", []):
                tf_name = _text(weight)
                name = pytorch_name(tf_name)
                if name not in expected:
                    raise CheckpointError(f"{source}: weight {tf_name} is no tensor of the config's GPT-2 ({name}).")
                value = np.asarray(group[tf_name], dtype=np.float32)
                if value.ndim == 2 and value.shape[0] == 1 and len(expected[name]) == 1:
                    value = value[0]  # Conv1D biases are [1, out] in TF
                if value.shape != expected[name]:
                    raise CheckpointError(f"{source}: {name} has shape {list(value.shape)}, the config's GPT-2 "
                                          f"{list(expected[name])}.")
                tensors[name] = value
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"{source}: no weights for {missing[:5]} ({len(missing)} tensors).")
    return tensors


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def convert_legacy_model(model_url: str, setting: str) -> bool:
    """Convert the model directory `model_url` once when it holds only tf_model.h5 (see the module); returns whether
    it converted. Raises CheckpointError starting with `setting` when it cannot be converted, saying what to do."""
    if not is_legacy_model(model_url):
        return False
    h5_url = storage.join(model_url, LEGACY_WEIGHTS)
    try:
        config = read_config(model_url)
        with tempfile.TemporaryDirectory(prefix="legacy-model-") as scratch:
            tensors = h5_tensors(storage.local_copy(h5_url, Path(scratch) / "h5"), config, h5_url)
            stage = Path(scratch) / "converted"
            stage.mkdir()
            shapes = {name: tuple(value.shape) for name, value in tensors.items()}
            write_file(stage / WEIGHTS_FILE, shapes, tensors.__getitem__, {"format": "pt"})
            record = {"converted_at": utc_now(), "source": LEGACY_WEIGHTS, "tensors": len(tensors)}
            (stage / CONVERTED_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
            storage.publish_files(stage, model_url, [WEIGHTS_FILE, CONVERTED_RECORD])
    except (CheckpointError, OSError) as error:
        raise CheckpointError(
            f"{setting}: {model_url} holds transformers 4.57's {LEGACY_WEIGHTS}, which could not be converted to "
            f"{WEIGHTS_FILE} ({error}). Promote a run trained since, or start from a preset or a hub model.") from None
    return True


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tasks.legacy_models MODEL_DIR_OR_URL", file=sys.stderr)
        return 2
    converted = convert_legacy_model(argv[0], argv[0])
    print(f"{argv[0]}: {'converted to ' + WEIGHTS_FILE if converted else 'nothing to convert'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


__all__ = ["CONVERTED_RECORD", "LEGACY_WEIGHTS", "convert_legacy_model", "h5_tensors", "is_legacy_model",
           "pytorch_name"]
