import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from models import save_model, save_text_model  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))
DEVICE = os.environ.get("PAGEDINFER_TEST_DEVICE", "cpu")
# engine settings of the tests that compare with transformers in float32 (on CUDA dtype auto is float16)
ENGINE = {"device": DEVICE, "dtype": "float32"}


@pytest.fixture(scope="session")
def model_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(model_root):
    """Path of a saved tiny model of the given family (built once per session)."""
    return lambda family: save_model(family, model_root)


@pytest.fixture(scope="session")
def text_model(model_root) -> Path:
    return save_text_model(model_root)
