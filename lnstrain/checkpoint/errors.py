"""The one error a checkpoint that cannot be used raises."""


class CheckpointError(ValueError):
    """A checkpoint file cannot be used as it is (unsafe to unpickle, corrupt, missing, or no
    checkpoint verifies). The message names the file and what to do; the launcher prints it and
    exits 2 without a traceback. ``agreed``: every rank raised this same message (the ranks verified
    the checkpoint together), so one rank printing it is enough."""

    def __init__(self, message: str, agreed: bool = False) -> None:
        super().__init__(message)
        self.agreed = agreed
