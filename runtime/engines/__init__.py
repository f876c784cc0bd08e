"""Engines: the backends that run a compiled graph (ONNX Runtime, its static CUDA width graphs, TensorRT), the
static KV cache they read and write, and the engine directory's manifest."""
