"""The Textual console over the pipeline engine (not built yet: `eagle3-console run --no-tui`)."""
