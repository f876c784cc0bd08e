"""Which backend runs an engine set's model: kept apart from the backends so that none of them imports another."""
from __future__ import annotations

from specrt.engines.base import OrtEngine
from specrt.engines.static import StaticWidthEngine
from specrt.engines.tensorrt import TensorRTEngine

def engine_class(entry: dict):
    """The backend class for a model's manifest engine entry."""
    if entry.get("backend") == "tensorrt":
        return TensorRTEngine
    if entry.get("widths"):
        return StaticWidthEngine
    return OrtEngine
