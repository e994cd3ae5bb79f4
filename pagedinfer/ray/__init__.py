"""Data-parallel engines on Ray: the `pagedinfer run --data-parallel` driver, its engine actors, and the Ray Data processor.

Ray is an optional extra (``pip install 'pagedinfer[ray]'``); nothing here imports it until a Ray
feature is used.
"""

from pagedinfer.ray.processor import ProcessorConfig, build_processor

__all__ = ["ProcessorConfig", "build_processor"]
