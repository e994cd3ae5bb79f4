"""The model side of a step: loading a Hugging Face decoder, one packed forward pass, sampling its logits."""
