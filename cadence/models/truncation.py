"""A model's first layers as a model of their own: a draft model for speculative decoding that needs
no second checkpoint (docs/speculative_decoding.md, "A draft from the model itself").

The copy keeps the embeddings, the first ``num_layers`` decoder layers, the final norm and the LM
head, so it shares the model's vocabulary and predicts its next token from an earlier layer's state
(as LayerSkip's early exit does; a model not trained for that exit predicts less well).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from cadence.config import ConfigError

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def truncate_model(folder: str | Path, dest: str | Path, num_layers: int) -> Path:
    """Write to ``dest`` the Hugging Face folder ``folder`` cut to its first ``num_layers`` layers
    (weights in one safetensors file; tokenizer and other files copied as they are).

    :raises ConfigError: ``num_layers`` is not between 1 and the model's layer count.
    """
    source, target = Path(folder), Path(dest)
    config = json.loads((source / "config.json").read_text())
    total = config["num_hidden_layers"]
    if not 1 <= num_layers <= total:
        raise ConfigError(f"num_layers must be between 1 and the model's {total} layers, got {num_layers}")
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json",
                                                                                 "model.safetensors.index.json"):
            shutil.copy2(path, target / path.name)
    config["num_hidden_layers"] = num_layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:num_layers]
    (target / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for path in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            layer = _LAYER.search(name)
            if layer is None or int(layer.group(1)) < num_layers:
                tensors[name] = tensor
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target
