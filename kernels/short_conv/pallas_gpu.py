"""Mosaic GPU kernel for the tap gradients of the causal short convolution + SiLU.

    y[t] = silu(a[t]),   a[t] = sum_i w[i] * x[t - s_i] * m_i[t],   s_i = W-1-i
    dw[i] = sum_{b,t} da[t] * x[t - s_i] * m_i[t],   da = dy * silu'(a)

where m_i[t] (0 or 1) says whether tap i's source token is in t's document. XLA sums these
W products over the B*T rows at about a tenth of the HBM bandwidth (a column reduction fused
with the pre-activation's recomputation); here each program walks a range of rows of one
(batch, channel block) with W float32 accumulators in registers and sums over rows once at the
end. a[t] and da[t] are recomputed from x and dy.

A program takes one (batch, channel block of BC, row split); tiles of BT rows stream in by TMA
through a ring of SMEM slots: dy, the masks, and x once per tap, each copy starting s_i rows
earlier (the W copies of a tile overlap, so all but one come from L2). The shift is the copy's:
register loads from SMEM start at multiples of 64 rows only, because on an H200 (jax 0.11.2) a
WGMMA-layout load from untiled SMEM at a row offset that is not a multiple of 8 returns wrong
values without an error, and tiled SMEM takes no copy at such a row. Tile 0 of a sequence
would need rows before t = 0: its masks are zeroed for the kernel and its rows summed by the
reference instead (1/(T/BT) of the work).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.lowering import lowered_once
from kernels.short_conv import reference

BT = 128  # rows per TMA tile (two 64-row register tiles)
SUB = 64  # rows of one WGMMA-layout register tile
BC = 32  # channels per program (default): W float32 accumulators of [64, BC] stay in registers
BLOCK_CS = (32, 64)  # 64: twice the registers per thread, half the copies per byte
# TMA ring depth: 2 was the fastest of 2, 3, 4 at both measured shapes on an H200 (0.156 / 0.179 /
# 0.181 ms at 4 x 4096 x 2048, 0.390 / 0.443 / 0.431 at 1 x 65536 x 2048;
# benchmarks/results/short-conv-h200-20261201T0129.json).
SLOTS = 2
MAX_W = 6
SMEM_LIMIT = 224 * 1024  # the H200's 227 KiB per block, less room for the barriers


def smem_bytes(W: int, dtype, slots: int, block_c: int = BC) -> int:
    """SMEM of one program: per slot W shifted x tiles, a dy tile and the masks; w and the sums."""
    tile = BT * block_c * jnp.dtype(dtype).itemsize
    return slots * ((W + 1) * tile + W * BT * 4) + 2 * W * block_c * 4


def unsupported_reason(T: int, C: int, W: int, dtype, slots: int = SLOTS, block_c: int = BC) -> str | None:
    """Why the kernel cannot take x [B, T, C] with W taps (None when it can)."""
    if T % BT:
        return f"T={T} is not a multiple of {BT}"
    if block_c not in BLOCK_CS:
        return f"block_c={block_c} (the kernel takes {BLOCK_CS})"
    if C % block_c:
        return f"channels={C} is not a multiple of {block_c}"
    if not 1 <= W <= MAX_W:
        return f"kernel_size={W} (the kernel takes 1..{MAX_W})"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        return f"dtype {jnp.dtype(dtype).name}"
    smem = smem_bytes(W, dtype, slots, block_c)
    if smem > SMEM_LIMIT:
        return (f"{slots} slots of W={W} {jnp.dtype(dtype).name} tiles need {smem // 1024} KiB of SMEM "
                f"(limit {SMEM_LIMIT // 1024})")
    return None


def row_splits(B: int, T: int, C: int, sms: int = 132, block_c: int = BC) -> int:
    """Row splits per (batch, channel block): enough programs for about two per SM, and at least
    four tiles per program so the TMA ring stays full."""
    want = -(-2 * sms // (B * (C // block_c)))
    tiles = T // BT
    divisors = [n for n in range(1, max(tiles // 4, 1) + 1) if tiles % n == 0]  # whole tiles per split
    return next((n for n in divisors if n >= want), divisors[-1])


def _body(x_ref, dy_ref, w_ref, m_ref, out_ref, xs, dys, ms, ws, os_, bars, wbar, *, W, NT, slots, BC, from_da):
    b, c, sp = lax.axis_index("b"), lax.axis_index("c"), lax.axis_index("s")
    cs = pl.ds(c * BC, BC)
    t_first = sp * (NT * BT)
    f32 = jnp.float32
    layout = plgpu.Layout.WGMMA
    n_bar = W + 2

    def issue(j, slot):
        t0 = t_first + j * BT
        for i in range(W):  # tile 0's rows before t = 0 clamp to row 0: masked, see tap_grads
            src = x_ref.at[b, pl.ds(jnp.maximum(t0 - (W - 1 - i), 0), BT), cs]
            plgpu.copy_gmem_to_smem(src, xs.at[slot, i], bars.at[n_bar * slot + i])
        plgpu.copy_gmem_to_smem(dy_ref.at[b, pl.ds(t0, BT), cs], dys.at[slot], bars.at[n_bar * slot + W])
        plgpu.copy_gmem_to_smem(m_ref.at[b, :, pl.ds(t0 // SUB, BT // SUB)], ms.at[slot], bars.at[n_bar * slot + W + 1])

    for j in range(min(slots - 1, NT)):
        issue(j, j)
    plgpu.copy_gmem_to_smem(w_ref.at[:, cs], ws, wbar.at[0])
    plgpu.barrier_wait(wbar.at[0])
    shape = (SUB, BC)
    cols = lambda v: lax.broadcast_in_dim(v, shape, [1])
    rows = lambda v: lax.broadcast_in_dim(v, shape, [0])
    wrow = [cols(plgpu.load(ws.at[i], layout=layout.reduce(0))) for i in range(W)]

    def step(j, accs):
        slot = lax.rem(j, slots)
        for k in range(n_bar):
            plgpu.barrier_wait(bars.at[n_bar * slot + k])
        accs = list(accs)
        for h in range(BT // SUB):
            r = pl.ds(h * SUB, SUB)

            def tap(i):  # x[t - s_i] for the 64 rows of this half, zero where the tap is masked
                xi = plgpu.load(xs.at[slot, i, r], layout=layout).astype(f32)
                mi = rows(plgpu.load(ms.at[slot, i, h], layout=layout.reduce(1)))  # a whole SMEM row
                return jnp.where(mi > 0, xi, 0.0)

            dy = plgpu.load(dys.at[slot, r], layout=layout).astype(f32)
            if from_da:
                da = dy
            else:
                a = None
                for i in range(W):
                    ai = tap(i) * wrow[i]
                    a = ai if a is None else a + ai
                sig = 1.0 / (1.0 + jnp.exp(-a))
                da = dy * (sig * (1.0 + a * (1.0 - sig)))
            for i in range(W):  # reloaded from SMEM: W held [64, BC] tiles would spill
                accs[i] = accs[i] + da * tap(i)
        nxt = j + slots - 1
        # The slot `nxt` refills held tile j - 1: every thread's reads of it come before the TMA
        # write (a fence and a warpgroup barrier).
        plgpu.commit_smem()

        @pl.when(nxt < NT)
        def _():
            issue(nxt, lax.rem(nxt, slots))

        return tuple(accs)

    zero = plgpu.layout_cast(jnp.zeros(shape, f32), layout)
    accs = lax.fori_loop(0, NT, step, tuple(zero for _ in range(W)))
    for i in range(W):
        os_[i] = accs[i].sum(axis=0)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(os_, out_ref.at[b, sp, :, cs])
    plgpu.wait_smem_to_gmem(0)


@lowered_once("splits", "slots", "block_c", "from_da", "per_batch", "interpret")
def tap_grads(x, dy, w, masks, *, splits: int | None = None, slots: int = SLOTS, block_c: int = BC,
              from_da: bool = False, per_batch: bool = False, interpret: bool = False):
    """x, dy [B, T, C] (bf16, f16 or f32); w [W, C]; masks [B, W, T] float32, 1 where tap i of
    row t reads a token of row t's document (`ops.tap_masks`).

    Returns dw [W, C] float32: sum over B, T of dy * silu'(a) * x[t - (W-1-i)] * masks[:, i]
    ([B, W, C], the sum over T only, with `per_batch`). `splits` row ranges per (batch, channel
    block) (default `row_splits`); `slots` SMEM slots of the TMA ring; `block_c` channels per
    program (one of BLOCK_CS). `from_da`: the second operand is da = dy * silu'(a) itself (any
    float dtype; float32 keeps the XLA forms' rounding), so the kernel does not recompute a.
    """
    B, T, C = x.shape
    W = w.shape[0]
    if slots < 2:
        raise ValueError(f"tap_grads needs slots >= 2; got {slots}")
    S = None
    if T % BT == 0 and block_c in BLOCK_CS and C % block_c == 0:
        S = row_splits(B, T, C, block_c=block_c) if splits is None else int(splits)
        if S < 1 or (T // BT) % S:
            raise ValueError(f"splits={S} must divide the {T // BT} tiles of {BT} rows")
        slots = min(slots, max(T // BT // S, 2))  # no more slots than tiles
    why = unsupported_reason(T, C, W, x.dtype, slots, block_c) or unsupported_reason(T, C, W, dy.dtype, slots, block_c)
    if why:
        raise ValueError(f"short-conv tap-gradient kernel: {why}")
    if dy.shape != x.shape or w.shape != (W, C) or masks.shape != (B, W, T):
        raise ValueError(f"tap_grads: x {x.shape}, dy {dy.shape}, w {w.shape}, masks {masks.shape}; expected "
                         f"dy = x's shape, w [W, {C}], masks [{B}, W, {T}]")
    NT = T // BT // S
    scratch = [
        plgpu.SMEM((slots, W, BT, block_c), x.dtype),  # untiled: the copies start at any row
        plgpu.SMEM((slots, BT, block_c), dy.dtype),
        plgpu.SMEM((slots, W, BT // SUB, SUB), jnp.float32),
        plgpu.SMEM((W, block_c), jnp.float32),
        plgpu.SMEM((W, block_c), jnp.float32),
        plgpu.Barrier(num_barriers=(W + 2) * slots),
        plgpu.Barrier(num_barriers=1),
    ]
    body = functools.partial(_body, W=W, NT=NT, slots=slots, BC=block_c, from_da=from_da)
    masks = masks.astype(jnp.float32)
    part = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((B, S, W, C), jnp.float32),
        scratch_types=scratch,
        grid=(B, C // block_c, S),
        grid_names=("b", "c", "s"),
        kernel_name="short_conv_tap_grads",
        compiler_params=plgpu.CompilerParams(approx_math=False),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(x, dy, w.astype(jnp.float32), masks.at[:, :, :BT].set(0.0).reshape(B, W, T // SUB, SUB))
    head = reference.tap_grads(x[:, :BT], dy[:, :BT], w, masks[:, :, :BT], from_da=from_da, per_batch=True)  # tile 0
    part = part.sum(axis=1) + head
    return part if per_batch else part.sum(axis=0)
