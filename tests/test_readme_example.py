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


def test_the_readme_example_speaks(tmp_path):
    """In an environment whose ``VLLM_PLUGINS`` leaves this package's plugin out (vLLM then loads only
    the plugins it names): the engines register the talker themselves (where the plugin is loaded,
    as by default, registering again changes nothing; ``test_the_plugin_registers_the_talker``)."""
    readme = (ROOT / "README.md").read_text()
    (code,) = [block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "OmniAsyncLLM" in block]
    script = tmp_path / "speak.py"
    script.write_text(code)
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_PLUGINS": "lora_filesystem_resolver"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split() for line in done.stdout.splitlines() if line.startswith("hello ")]
    # DELTA at the talker's cadence (four frames): 25 frames arrive as 1 + 4 * 6 frames
    assert lines and sum(int(re.search(r"\d+", words[1]).group()) for words in lines) == 25 * 1920, done.stdout


def test_the_plugin_registers_the_talker(tmp_path):
    """The ``vllm.general_plugins`` entry point, as vLLM loads it in each of its processes."""
    code = ("from vllm import ModelRegistry; from vllm.plugins import load_general_plugins; load_general_plugins(); "
            "print('OmniTalkerForTTS' in ModelRegistry.get_supported_archs())")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**env, "VLLM_TARGET_DEVICE": "cpu"},
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.split()[-1:] == ["True"], done.stderr[-3000:]
