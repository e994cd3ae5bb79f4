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


def pytest_addoption(parser):
    parser.addoption(
        "--no-real-model",
        action="store_true",
        help="skip the real-model tier (tests/test_real_model.py, which fetches a 93 MB package once); "
        "same as PAGEDINFER_SKIP_REAL_MODEL=1. CI never skips it.",
    )


def pytest_collection_modifyitems(config, items):
    """The real-model tier runs unless skipped explicitly: a failed download is a failure, not a skip."""
    if config.getoption("--no-real-model") or os.environ.get("PAGEDINFER_SKIP_REAL_MODEL") == "1":
        skip = pytest.mark.skip(
            reason="real-model tier skipped (--no-real-model or PAGEDINFER_SKIP_REAL_MODEL=1)"
        )
        for item in items:
            if "real_model" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def tokenizer_cache(tmp_path_factory) -> Path:
    """The session's tokenizer snapshots (`model.tokenizer_snapshot`) in a folder of its own, not the
    user's cache: a model's first load in the session goes through transformers, later ones through
    the snapshot (child processes inherit it)."""
    folder = tmp_path_factory.mktemp("tokenizers")
    os.environ["PAGEDINFER_TOKENIZER_CACHE"] = str(folder)
    return folder


@pytest.fixture(scope="session")
def model_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def gguf_dir(model_root) -> Path:
    """Where the GGUF tests write their random models and files (tests/test_gguf_types.py)."""
    out = model_root / "gguf-types"
    out.mkdir(exist_ok=True)
    return out


@pytest.fixture(scope="session")
def tiny_model(model_root):
    """Path of a saved tiny model of the given family (built once per session)."""
    return lambda family: save_model(family, model_root)


@pytest.fixture(scope="session")
def text_model(model_root) -> Path:
    return save_text_model(model_root)
