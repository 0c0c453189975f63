"""The Textual console over the pipeline engine: `eagle3-console run PROFILE` or `attach RUN_DIR` opens it."""
