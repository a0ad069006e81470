"""Every Python example in docs/PYTHON.md runs (those importing torch only where it is installed)."""

import importlib.util
import pathlib
import re

import pytest

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "PYTHON.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_example_runs(index):
    code = EXAMPLES[index]
    if "import torch" in code and importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch")
    exec(compile(code, f"{PAGE.name} example {index}", "exec"), {})
