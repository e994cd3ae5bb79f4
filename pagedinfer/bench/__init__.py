"""`pagedinfer bench`: pagedinfer against transformers on the same prompts and model, in one run."""
