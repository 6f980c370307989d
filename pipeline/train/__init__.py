"""Training state on disk: named state dicts, optimizer state, the checkpoint directory."""
