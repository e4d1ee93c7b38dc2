"""ruff, configured in pyproject.toml, finds nothing: `make test` is also the lint."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=ROOT, capture_output=True, text=True)
    assert "No module named ruff" not in done.stderr, "ruff is missing: pip install -e '.[test]'"
    assert done.returncode == 0, done.stdout + done.stderr
