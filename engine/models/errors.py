class ModelLoadError(ValueError):
    """A model file or directory that cannot be used, with the reason in the message."""
