"""The README's Python examples run as written."""

from __future__ import annotations

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    exec(compile(BLOCKS[index], f"README.md example {index}", "exec"), {})


def test_readme_has_the_two_setup_commands():
    text = README.read_text()
    assert 'pip install torch==2.13.0 . && infinity finetune' in text
    assert 'pip install torch==2.13.0 ".[test]" && pytest -q' in text
