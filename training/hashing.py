"""SplitMix64's finalizer: a cheap, well-mixed 64-bit hash, for the RNG seeds that must be
pure functions of (seed, step, logical rank), computed on every step."""

from __future__ import annotations

MASK64 = 2**64 - 1
GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (the golden ratio) and mixing constants
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def mix64(z: int) -> int:
    """The finalizer on a Python int (taken mod 2**64)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)
