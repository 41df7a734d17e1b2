"""The one error type of failed collectives (kept apart so every comm module can raise it)."""


class DistributedError(RuntimeError):
    """A collective failed: a peer died, hung past the timeout, or disagrees with this rank."""
