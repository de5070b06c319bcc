"""An out-of-tree model package, exactly as docs/models.md shows it, installed and run.

The two files are cut from the page, pip-installed into a temporary folder (no network: no build
isolation, no dependencies), and a fresh interpreter with that folder on its path, where the
package's ``.dist-info`` registers its entry point, must list the architecture and generate with it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"
ARCHITECTURE = "TinyParrotForCausalLM"

# Run in the child: the architecture is listed, and the parrot checkpoint generates Llama's tokens.
_CHILD = """
import json, sys
from cadence import LLM, SamplingParams
from cadence.models.registry import installed_architectures

entry = installed_architectures()[sys.argv[3]]
prompts = [[5, 6, 7, 8], [40, 41, 300, 2, 9, 17]]
params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
tokens = {}
for label, folder in (("llama", sys.argv[1]), ("parrot", sys.argv[2])):
    llm = LLM(model=folder, dtype="float32", num_threads=1)
    tokens[label] = [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
print(json.dumps({"entry": entry.value, "class": entry.load().__qualname__, **tokens}))
"""


def documented_file(name: str, language: str) -> str:
    """The code block of ``language`` that follows the line naming ``name`` in docs/models.md."""
    pattern = rf"^`{re.escape(name)}`\n\n```{language}\n(.*?)^```$"
    found = re.search(pattern, DOC.read_text(), re.MULTILINE | re.DOTALL)
    assert found, f"docs/models.md has no {language} block for {name}"
    return found.group(1)


def install_documented_package(tmp_path: Path) -> Path:
    """Write the page's package to ``tmp_path/src`` and install it into ``tmp_path/site``."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "tiny_parrot.py").write_text(documented_file("tiny_parrot.py", "python"))
    (source / "pyproject.toml").write_text(documented_file("pyproject.toml", "toml"))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(site), str(source)], check=True, capture_output=True)
    return site


def parrot_checkpoint(llama: Path, dest: Path) -> Path:
    """The tiny Llama's checkpoint under the plugin's architecture name (model_type stays llama)."""
    shutil.copytree(llama, dest)
    config = json.loads((dest / "config.json").read_text())
    config["architectures"] = [ARCHITECTURE]
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_the_documented_plugin_installs_and_generates_like_llama(tmp_path: Path,
                                                                  make_tiny_model: Callable[..., Path]) -> None:
    site = install_documented_package(tmp_path)
    assert list(site.glob("cadence_tiny_parrot-*.dist-info/entry_points.txt"))
    llama = make_tiny_model("llama")
    parrot = parrot_checkpoint(llama, tmp_path / "parrot")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, "-c", _CHILD, str(llama), str(parrot), ARCHITECTURE],
                           env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-4000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["entry"] == f"tiny_parrot:{ARCHITECTURE}"
    assert result["class"] == ARCHITECTURE
    assert len(result["llama"]) == 2 and all(len(tokens) == 12 for tokens in result["llama"])
    assert result["parrot"] == result["llama"]
