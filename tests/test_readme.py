"""The README's example runs as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README.md has no python example"
    namespace = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    assert namespace["o"].shape == (2, 128, 4, 64)
    assert namespace["state"].shape == (2, 4, 64, 64)
    assert namespace["layer"].quantization_error < 0.5


def test_readme_has_exactly_two_commands():
    commands = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    lines = [line for block in commands for line in block.splitlines() if line.strip()]
    assert [line.split("#")[0].strip() for line in lines] == [
        "bash scripts/demo.sh",
        "bash scripts/test.sh",
    ]
    assert "bash scripts/test.sh" in (README.parent / ".ci" / "run").read_text()
