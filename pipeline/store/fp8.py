"""fp8 (e4m3) hidden states with one float32 scale per token: half the bytes of bf16, lossy.

Stored bits follow the OCP float8 e4m3fn encoding (no infinities; 0x7F/0xFF are NaN). Decoding uses a
256-entry table, so a reader needs numpy only. Encoding rounds with torch, which the producer already has, so it
lives on the producer's side (`pipeline.extract.state_encoding.fp8_encode`): the store never imports torch.
Per-token scales keep each token's largest value at the top of e4m3's range (448), so a few outlier
dimensions cost precision only within their own token.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

E4M3_MAX = 448.0


def _decode_table() -> np.ndarray:
    codes = np.arange(256, dtype=np.uint32)
    sign = np.where(codes >> 7, -1.0, 1.0)
    exponent = ((codes >> 3) & 0xF).astype(np.int32)
    mantissa = (codes & 0x7).astype(np.float64)
    values = np.where(exponent == 0, mantissa / 8.0 * 2.0 ** -6, (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7.0))
    values = sign * values
    values[(exponent == 15) & (mantissa == 7)] = np.nan
    return values.astype(np.float32)


DECODE_TABLE = _decode_table()


def decode(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """codes [L, d] (uint8, or the same bytes as ml_dtypes.float8_e4m3fn), scales float32 [L] -> float32 [L, d]."""
    return DECODE_TABLE[_code_bytes(codes)] * np.asarray(scales, dtype=np.float32)[:, None]


def _code_bytes(codes: np.ndarray) -> np.ndarray:
    """e4m3fn codes as uint8, whether typed (ml_dtypes.float8_e4m3fn, what readers return) or raw."""
    codes = np.asarray(codes)
    return codes.view(np.uint8) if codes.dtype == ml_dtypes.float8_e4m3fn else codes


def non_finite_count(codes: np.ndarray) -> int:
    return int(np.count_nonzero((_code_bytes(codes) & 0x7F) == 0x7F))
