"""Q4_K and Q6_K blocks for tests, which gguf-py can read (`gguf.quants.dequantize`) but not
write: a plain round-to-nearest quantizer (not llama.cpp's search for the best scales), and
random valid blocks. Rows of `x` are output rows; their length is a multiple of 256."""

from __future__ import annotations

import numpy as np

QK = 256


def _fp16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """uint8 [rows, K/256 * 144]: per super-block d, dmin (fp16), 12 bytes of 6-bit scales and
    mins (ggml's get_scale_min_k4 layout), 128 bytes of 4-bit codes."""
    rows, cols = x.shape
    sub = x.reshape(rows, cols // QK, 8, 32).astype(np.float32)
    low = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - low) / 15.0
    d = scale.max(-1) / 63.0
    dmin = (-low).max(-1) / 63.0
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.nan_to_num(np.round(scale / d16[..., None])).clip(0, 63).astype(np.uint8)
        m = np.nan_to_num(np.round(-low / dmin16[..., None])).clip(0, 63).astype(np.uint8)
        a = d16[..., None] * sc
        q = np.nan_to_num(np.round((sub + (dmin16[..., None] * m)[..., None]) / a[..., None]))
    q = q.clip(0, 15).astype(np.uint8).reshape(rows, cols // QK, QK)
    scales = np.zeros((rows, cols // QK, 12), np.uint8)
    for j in range(4):
        scales[..., j] = (sc[..., j] & 63) | ((sc[..., j + 4] >> 4) << 6)
        scales[..., j + 4] = (m[..., j] & 63) | ((m[..., j + 4] >> 4) << 6)
        scales[..., j + 8] = (sc[..., j + 4] & 0xF) | ((m[..., j + 4] & 0xF) << 4)
    qs = np.zeros((rows, cols // QK, 128), np.uint8)
    for c in range(4):
        qs[..., 32 * c : 32 * c + 32] = q[..., 64 * c : 64 * c + 32] | (
            q[..., 64 * c + 32 : 64 * c + 64] << 4
        )
    blocks = np.concatenate([_fp16(d16), _fp16(dmin16), scales, qs], axis=-1)
    return np.ascontiguousarray(blocks.reshape(rows, -1))


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """uint8 [rows, K/256 * 210]: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales
    (one per 16 weights), d (fp16); a weight is d * scale * (q - 32)."""
    rows, cols = x.shape
    sub = x.reshape(rows, cols // QK, 16, 16).astype(np.float32)
    scale = np.abs(sub).max(-1) / 31.0
    d = scale.max(-1) / 127.0
    d16 = d.astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.nan_to_num(np.round(scale / d16[..., None])).clip(-128, 127).astype(np.int8)
        a = d16[..., None] * sc
        q = np.nan_to_num(np.round(sub / a[..., None]))
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(rows, cols // QK, QK)
    ql = np.zeros((rows, cols // QK, 128), np.uint8)
    qh = np.zeros((rows, cols // QK, 64), np.uint8)
    for h in range(2):
        base = 128 * h
        ql[..., 64 * h : 64 * h + 64] = (q[..., base : base + 64] & 0xF) | (
            (q[..., base + 64 : base + 128] & 0xF) << 4
        )
        qh[..., 32 * h : 32 * h + 32] = (
            (q[..., base : base + 32] >> 4)
            | ((q[..., base + 32 : base + 64] >> 4) << 2)
            | ((q[..., base + 64 : base + 96] >> 4) << 4)
            | ((q[..., base + 96 : base + 128] >> 4) << 6)
        )
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), _fp16(d16)], axis=-1)
    return np.ascontiguousarray(blocks.reshape(rows, -1))


QUANTIZERS = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}
BYTES = {"Q4_K": 144, "Q6_K": 210}


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    """Blocks of random bytes (every code, scale and min pattern) with small finite fp16 factors
    (times `scale`)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // QK, BYTES[kind]), dtype=np.uint8)
    factors = ((rng.random((rows, cols // QK)) * 0.02 - 0.005) * scale).astype(np.float32)
    if kind == "Q4_K":
        blocks[..., 0:2] = _fp16(factors)
        blocks[..., 2:4] = _fp16(np.abs(factors) * 0.5)
    else:
        blocks[..., 208:210] = _fp16(factors)
    return np.ascontiguousarray(blocks.reshape(rows, -1))
