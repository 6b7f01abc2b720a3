"""The README's Python example, run as a user runs it: extracted from the README, in a fresh
directory, as a script (marker vllm). It must print the audio of every output it got."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("plugins", [None, "lora_filesystem_resolver"])
def test_the_readme_example_speaks(tmp_path, plugins):
    """Also where the environment's ``VLLM_PLUGINS`` leaves this package's plugin out (vLLM then loads
    only the plugins it names): the engines register the talker themselves."""
    readme = (ROOT / "README.md").read_text()
    (code,) = [block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "OmniAsyncLLM" in block]
    script = tmp_path / "speak.py"
    script.write_text(code)
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split() for line in done.stdout.splitlines() if line.startswith("hello ")]
    # DELTA at the talker's cadence (four frames): 25 frames arrive as 1 + 4 * 6 frames
    assert lines and sum(int(re.search(r"\d+", words[1]).group()) for words in lines) == 25 * 1920, done.stdout
