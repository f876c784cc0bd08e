"""Specific exception types; each message names the bad value and the fix."""


class SpecrtError(Exception):
    """Base class of every error specrt raises on purpose."""


class UnknownSourceError(SpecrtError):
    pass


class ManifestError(SpecrtError):
    """The engine directory does not match its manifest (missing file, wrong hash, bad pair)."""


class InputError(SpecrtError):
    """A request that cannot be served as asked (prompt too long, bad sampling parameter...)."""


class BackendError(SpecrtError):
    pass


class DeviceError(BackendError):
    """The engine set and the device do not go together: built for CUDA where there is none, built for the CPU and
    asked to run on CUDA, or engines that run on CUDA only (bfloat16, TensorRT) asked to run on the CPU."""


class MemoryLimitError(SpecrtError):
    """An export or build that would not fit the memory available, said before the work starts (names the sizes)."""


class CheckpointError(InputError):
    """A drafter checkpoint that cannot be read safely or as the layout it claims: a pickle that holds more than
    tensors, a file type specrt does not read, weights missing or of the wrong shape (names the file and the fix)."""


class DrafterMismatchError(InputError):
    """A drafter that does not fit its target (hidden size, vocabulary, architecture, layer ids): names both
    values."""
