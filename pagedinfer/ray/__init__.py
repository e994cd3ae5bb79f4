"""Data-parallel engines on Ray: the `pagedinfer run --data-parallel` driver, its engine actors, and the Ray Data processor.

Ray is an optional extra (``pip install 'pagedinfer[ray]'``); nothing here imports it until a Ray
feature is used. ``build_processor`` is the Ray Data API (`processor.py`).
"""

from __future__ import annotations


def build_processor(config, preprocess=None, postprocess=None):
    """A callable turning a Ray Dataset of request rows into rows with outputs (see `processor.py`)."""
    from pagedinfer.ray.processor import build_processor as build

    return build(config, preprocess=preprocess, postprocess=postprocess)


def __getattr__(name: str):
    if name == "ProcessorConfig":
        from pagedinfer.ray.processor import ProcessorConfig

        return ProcessorConfig
    raise AttributeError(name)
