"""The training data: conversations and their sources, the demo corpus and target, hidden states, online training."""
