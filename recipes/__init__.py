raise ImportError("recipes are entry points: run them with `accelerate launch recipes/<name>.py`, don't import them")
