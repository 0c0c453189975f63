"""A run on disk (the lowest layer): run directory, atomic writes, results, the decision, matrix levels, checkpoints."""
