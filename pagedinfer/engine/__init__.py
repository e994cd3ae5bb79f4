"""The engine: turns prompts into requests and drives the step loop (schedule -> execute -> sample -> update)."""
