"""The block-shape / grid plan of the Pallas TPU KDA kernels, as pure data.

`plan(B, T, H, K, V, dtype)` returns every grid, block shape, dimension semantics and the VMEM
bytes per grid step of the four kernels, so the TPU tiling rules and the VMEM budget can be
checked for real shapes without running (or owning) a TPU. The kernels build their BlockSpecs
from this plan, so what is checked is what runs.

Grid of every stage: (B, H, NT) with NT = ceil(T / chunk). Layouts of per-token tensors:
  "flat"        [B, T, H*D], block (C, D)  when D % 128 == 0 (a free reshape of [B, T, H, D]);
  "head_major"  [B, H, T, D], block (C, D)  otherwise (a transpose; D is then the full last dim).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

SUPPORTED_DIMS = (64, 128)
SUPPORTED_DTYPES = ("float32", "bfloat16")
DEFAULT_CHUNK = 64
LANES = 128
# Default scoped-VMEM limits (bytes): v5e 16 MiB, v6e 32 MiB; physical VMEM is 128 MiB on both.
SCOPED_VMEM_LIMIT = {"v5e": 16 * 2**20, "v6e": 32 * 2**20}


def sublane_tile(dtype: str) -> int:
    """Rows of one native VMEM tile: 8 for 32-bit, 16 for bf16 (two rows packed per sublane)."""
    return {4: 8, 2: 16, 1: 32}[itemsize(dtype)]


def itemsize(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize  # numpy has no bf16


@dataclasses.dataclass(frozen=True)
class Operand:
    """One kernel operand: its HBM array shape, block shape (None = squeezed dim) and index kind.

    Index kinds (all over the grid (b, h, n)): "tok" a (C, D) token tile in the plan's layout;
    "seg_row" [B, NT, 1, C] per-token segment counters shared by the heads; "chunk"
    [B, H, NT, X, Y] one matrix (or [1, N] row: beta, decay) per chunk; "head" [B, H, X, Y] one
    matrix per (batch, head), resident across n.
    """

    name: str
    array_shape: tuple
    block_shape: tuple
    dtype: str
    index: str

    @property
    def tile(self) -> tuple[int, int]:
        return tuple(1 if d is None else d for d in self.block_shape[-2:])

    def tiling_error(self) -> str | None:
        """Why the block breaks the TPU rule (last two block dims divisible by the native tile or
        equal to the array's dims), or None."""
        (r, c), (ar, ac) = self.tile, self.array_shape[-2:]
        sub = sublane_tile(self.dtype)
        if not (r % sub == 0 or r == ar):
            return f"{self.name}: block rows {r} neither a multiple of {sub} nor the array's {ar}"
        if not (c % LANES == 0 or c == ac):
            return f"{self.name}: block cols {c} neither a multiple of {LANES} nor the array's {ac}"
        return None

    @property
    def vmem_bytes(self) -> int:
        """Bytes of one VMEM buffer of the block, padded to native tiles."""
        r, c = self.tile
        sub = sublane_tile(self.dtype)
        lead = math.prod(d for d in self.block_shape[:-2] if d is not None)
        return lead * (-(-r // sub) * sub) * (-(-c // LANES) * LANES) * itemsize(self.dtype)


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pallas_call: grid (B, H, NT), its semantics, operands and scratch."""

    name: str
    grid: tuple[int, int, int]
    dimension_semantics: tuple[str, str, str]
    inputs: tuple[Operand, ...]
    outputs: tuple[Operand, ...]
    scratch: tuple[Operand, ...]
    reverse: bool  # chunks visited n = NT-1 .. 0
    temporaries: int  # live f32 (C, 128)-sized values in the body (estimate, for the VMEM budget)
    chunk: int

    @property
    def vmem_bytes(self) -> int:
        """Per grid step: double-buffered in/out blocks + scratch + body temporaries."""
        io = sum(op.vmem_bytes for op in self.inputs + self.outputs)
        temps = self.temporaries * self.chunk * LANES * 4
        return 2 * io + sum(op.vmem_bytes for op in self.scratch) + temps


@dataclasses.dataclass(frozen=True)
class Plan:
    B: int
    T: int
    H: int
    K: int
    V: int
    dtype: str
    chunk: int
    Tp: int
    NT: int
    layout: str
    stages: tuple[Stage, ...]

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise ValueError(f"Unknown stage {name!r}; expected one of {[s.name for s in self.stages]}")

    def tiling_errors(self) -> list[str]:
        ops = [op for s in self.stages for op in s.inputs + s.outputs]
        return [e for e in (op.tiling_error() for op in ops) if e]


def unsupported_reason(K: int, V: int, dtype: str, chunk: int = DEFAULT_CHUNK) -> str | None:
    """Why the TPU kernels cannot take this call, or None."""
    if K not in SUPPORTED_DIMS or V not in SUPPORTED_DIMS:
        return f"K={K}, V={V}: the TPU kernels support K and V in {SUPPORTED_DIMS}"
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype}: the TPU kernels support {SUPPORTED_DTYPES}"
    if chunk not in (32, 64, 128):
        return f"chunk={chunk}: expected one of 32, 64, 128"
    return None


def plan(B: int, T: int, H: int, K: int, V: int, dtype, chunk: int = DEFAULT_CHUNK) -> Plan:
    """Grids, block shapes and VMEM bytes of the four kernels for q, k [B, T, H, K], v [B, T, H, V]."""
    dtype = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    reason = unsupported_reason(K, V, dtype, chunk)
    if reason:
        raise ValueError(reason)
    C = chunk
    NT = -(-T // C)
    Tp = NT * C
    layout = "flat" if K % LANES == 0 and V % LANES == 0 else "head_major"
    f32 = "float32"

    def tok(name, D, dt=dtype):
        if layout == "flat":
            return Operand(name, (B, Tp, H * D), (None, C, D), dt, "tok")
        return Operand(name, (B, H, Tp, D), (None, None, C, D), dt, "tok")

    def chunk_mat(name, X, Y, dt=f32):
        return Operand(name, (B, H, NT, X, Y), (None, None, None, X, Y), dt, "chunk")

    def head_mat(name):
        return Operand(name, (B, H, K, V), (None, None, K, V), f32, "head")

    beta = chunk_mat("beta", 1, C)
    seg_row = Operand("seg_row", (B, NT, 1, C), (None, None, 1, C), f32, "seg_row")
    decay = chunk_mat("decay", 1, K)
    grid = (B, H, NT)
    par, seq = ("parallel",) * 3, ("parallel", "parallel", "arbitrary")
    state = Operand("S", (K, V), (K, V), f32, "scratch")
    b_rows = Operand("b_rows", (C, K), (C, K), f32, "scratch")  # rows read at traced offsets
    qkvg = (tok("q", K), tok("k", K), tok("v", V), tok("G", K, f32), beta, seg_row)
    wy = (tok("qg", K), tok("kg", K), tok("w", K))
    stages = (
        Stage(
            "fwd_prepare", grid, par, qkvg,
            wy + (tok("u", V), chunk_mat("aqk", C, C, dtype), chunk_mat("ai", C, C)), (b_rows,), False, 24, C,
        ),
        Stage(
            "fwd_state", grid, seq,
            wy + (tok("u", V), chunk_mat("aqk", C, C, dtype), decay, head_mat("h0")),
            (tok("o", V), tok("vn", V), chunk_mat("hs", K, V), head_mat("ht")), (state,), False, 6, C,
        ),
        Stage(
            "bwd_state", grid, seq,
            wy + (chunk_mat("aqk", C, C, dtype), decay, tok("do", V), head_mat("dht")),
            (tok("dvn", V, f32), chunk_mat("dh", K, V), head_mat("dh0")), (state,), True, 6, C,
        ),
        Stage(
            "bwd_chunk", grid, par,
            qkvg + (chunk_mat("ai", C, C), chunk_mat("hs", K, V), chunk_mat("dh", K, V), tok("vn", V),
                    tok("dvn", V, f32), tok("do", V)),
            (tok("dq", K), tok("dk", K), tok("dv", V), chunk_mat("dbeta", 1, C), tok("dG", K, f32),
             chunk_mat("ddecay", 1, K)),
            (b_rows,), False, 40, C,
        ),
    )
    return Plan(B, T, H, K, V, dtype, C, Tp, NT, layout, stages)
