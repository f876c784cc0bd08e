"""Decoding: the loop (propose, verify, accept, commit), the drafters, the lossless verification rules, sampling,
trees and the adaptive policies that size speculation."""
