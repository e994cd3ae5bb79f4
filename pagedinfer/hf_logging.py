"""transformers' warnings and progress bars kept off the command line's stderr, without importing it.

The command line and the Ray replicas write their own words for what transformers would warn about
(a capped context, a missing file...), and their own progress. Importing transformers only to set its
verbosity costs most of a second of a run that may not need it otherwise, so where it is not yet
imported its own environment switches are set instead, which it reads when it is imported:
``TRANSFORMERS_VERBOSITY`` (its logging level) and huggingface_hub's ``HF_HUB_DISABLE_PROGRESS_BARS``
(which transformers' progress bars follow), or huggingface_hub's switch itself once it is imported.
"""

from __future__ import annotations

import os
import sys


def quiet_transformers() -> None:
    """transformers' logging at errors only and its progress bars off, now or when it is imported
    (what its ``set_verbosity_error`` and ``disable_progress_bar`` do)."""
    if "transformers.utils.logging" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        return
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    if "huggingface_hub.utils" in sys.modules:  # its switch is read: set it as transformers would
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    else:
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
