"""specrt: speculative decoding with exact verification over compiled engines."""
from specrt.errors import BackendError, InputError, ManifestError, SpecrtError, UnknownSourceError
from specrt.decoding.generate import Chunk, Generation, Generator

__all__ = ["Generator", "Generation", "Chunk", "SpecrtError", "InputError", "ManifestError", "BackendError",
           "UnknownSourceError"]
__version__ = "0.1.0"
