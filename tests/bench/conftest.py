import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # fake_server

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def load_benchmark():
    """`load_benchmark("fairness")`: benchmarks/fairness.py as a module (the folder is not a package)."""
    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(f"{name}_bench", ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return load
