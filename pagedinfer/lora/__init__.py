"""LoRA adapters served beside the base weights: PEFT loading, adapter slots, per-step row groups, the deltas."""
