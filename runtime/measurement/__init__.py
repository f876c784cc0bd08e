"""Measurement: benchmarks and their reports, the llama.cpp peer, memory readings, the statistical losslessness
check, the GPU check, EAGLE's speedup projection and the server's load benchmark."""
