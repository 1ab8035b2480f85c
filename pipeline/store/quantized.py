"""The lossy dtypes of the store: codes of one byte per value, with one float32 scale per token beside.

- `float8_e4m3`: OCP e4m3fn codes (pipeline/store/fp8.py), scale = the token's largest magnitude / 448.
- `int8`: symmetric integer codes -127..127, scale = the token's largest magnitude / 127; value = code x
  scale. Its codes have about 4.8 bits of entropy on real hidden states against e4m3's 6.8 (e4m3 spends its
  bits on exponents that small values rarely need), so with zstd an int8 store is ~0.30 x raw bf16 and an
  e4m3 one ~0.42 (docs/benchmarks.md, "Smaller stores"); the per-token cosine to the bf16 states is 0.9994+
  for int8 against 0.9997+ for e4m3.

Decoding needs numpy only; encoding rounds with torch on the producer's side
(`pipeline.extract.state_encoding`), so the store never imports torch.
"""
from __future__ import annotations

import numpy as np

from pipeline.store import fp8
from pipeline.store.errors import StoreFormatError

INT8_MAX = 127.0
# dtype -> the largest code magnitude a scale maps the token's largest value to
CODE_MAX = {"float8_e4m3": fp8.E4M3_MAX, "int8": INT8_MAX}


def decode(logical: str, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """codes [L, d] of a lossy `logical` dtype, scales float32 [L] -> float32 [L, d]."""
    if logical == "float8_e4m3":
        return fp8.decode(codes, scales)
    if logical == "int8":
        return np.asarray(codes).astype(np.float32) * np.asarray(scales, dtype=np.float32)[:, None]
    raise StoreFormatError(f"{logical!r} is not a lossy store dtype; use one of {sorted(CODE_MAX)}")


def non_finite_count(logical: str, codes: np.ndarray) -> int:
    """Codes that decode to NaN (e4m3fn has two; integer codes have none)."""
    return fp8.non_finite_count(codes) if logical == "float8_e4m3" else 0
