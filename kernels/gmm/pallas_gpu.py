"""Grouped matmul on Hopper with Pallas Mosaic GPU (wgmma + TMA pipelines), forward and backward.

Layout: rows of `lhs [M, K]` are sorted by group; `group_sizes [G]` says how many rows each group
owns (empty groups allowed, rows past the total are zero in the output).

gmm  (forward and dlhs): one program per (M block, N block), launched in bands of N blocks
     for L2 reuse (`_banded`). It walks the groups that overlap its block of rows (usually
     one; two or more only at group boundaries), runs a K-pipeline of wgmma against that
     group's weights and keeps only the rows of that group (row mask on the accumulator).
     Each output row belongs to exactly one group, so the masked merge is exact and the whole
     [bm, bn] tile leaves with one TMA store; no ragged stores are needed.
tgmm (drhs): one program per (group, row split, K block, N block). It pipelines over the M
     blocks of the group (of its split), zeroes the rows of `dout` outside the group in the
     boundary blocks and accumulates lhs_blk^T @ dout_blk into a [bk, bn] tile of out[g].

Group metadata (offsets, first/last group of every M block) is computed by XLA outside the
kernel. M, N and K are padded to block multiples outside the kernel (zero padding changes
nothing). Operands must be 16-bit floats (bf16/f16, the wgmma types with transposed operands);
accumulation is f32. On CPU the same kernels run in the Mosaic GPU interpreter (`interpret=True`).
`Blocks(wgs=2)` selects the warp-specialized persistent variants of `pallas_gpu_ws`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.lowering import lowered_once


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tile sizes: bm rows x bn columns of output, bk of contraction; `stages` TMA buffers."""

    bm: int = 128
    bn: int = 128
    bk: int = 64
    stages: int = 4
    band: int = 8  # launch order: `band` N blocks of one M block, then the next M block (L2)
    wgs: int = 1  # 2: the warp-specialized persistent kernels of `pallas_gpu_ws`
    chain: bool = False  # wgs=2 gmm: one pipeline across tiles (see `pallas_gpu_ws.gmm`)

    def __post_init__(self):
        for name in ("bm", "bn", "bk"):
            v = getattr(self, name)
            if v % 64:
                raise ValueError(f"Blocks.{name}={v} must be a multiple of 64 (wgmma tiles)")
        if self.stages < 2:
            raise ValueError(f"Blocks.stages={self.stages} must be >= 2 (one wgmma in flight)")
        if self.band < 1:
            raise ValueError(f"Blocks.band={self.band} must be >= 1")
        if self.wgs not in (1, 2):
            raise ValueError(f"Blocks.wgs={self.wgs} must be 1 or 2 (compute warpgroups)")


SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)


def _pad_to(x, axis, multiple):
    pad = (-x.shape[axis]) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _group_loop(g0, g1, one_group):
    """one_group(g, None) for g in [g0, g1), g0 and g1 read from refs. The loop counts from 0, not
    from g0: inside shard_map (expert_parallel) values read from refs carry the mesh's varying
    axes while the kernel's own arithmetic does not, so a counter started at g0 would change type
    between iterations (a trace-time error)."""
    jax.lax.fori_loop(0, g1 - g0, lambda j, carry: one_group(g0 + j, carry), None)


def _offsets(group_sizes):
    """[G + 1] int32 start row of every group, then the total."""
    gs = group_sizes.astype(jnp.int32)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(gs, dtype=jnp.int32)])


def _block_groups(offsets, num_m_blocks, bm):
    """First and one-past-last group overlapping each M block (empty groups inside are skipped
    by the kernel): [num_m_blocks] int32 each."""
    row0 = jnp.arange(num_m_blocks, dtype=jnp.int32) * bm
    # compare_all: one fused [blocks, G] comparison instead of the default binary search, which
    # lowers to a while loop of small kernels (a cost of its own at small shapes).
    first = jnp.searchsorted(offsets[1:], row0, side="right", method="compare_all")
    last = jnp.searchsorted(offsets[:-1], row0 + bm, side="left", method="compare_all")
    return first.astype(jnp.int32), last.astype(jnp.int32)


def _banded(t, num_m, num_n, band):
    """Tile (mb, nb) of launch index t: the N blocks are cut into bands of `band` columns and
    each band is walked M block by M block, N fastest. The CTAs resident at one time then
    share ~132/band lhs row blocks and `band` weight column blocks, which stay in L2 (lhs is
    read num_n/band times from HBM instead of num_n times with an M-fastest order)."""
    full = num_m * band
    b = t // full
    width = jnp.minimum(band, num_n - b * band)
    r = t - b * full
    return r // width, b * band + r % width


def _row_iota(shape):
    """Row index of every element, in the wgmma accumulator's register layout."""
    return plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)


def _swizzled(minor: int, dtype):
    """Explicit SMEM tiling + swizzle for a tile that is both read into registers and fed to
    wgmma (tgmm masks its boundary tiles in place)."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits)
    return (plgpu.TilingTransform((8, 8 * swizzle // bits)), plgpu.SwizzleTransform(swizzle))


def _params(interpret):
    return plgpu.InterpretGPUParams() if interpret else None


def _check_dtypes(*xs):
    for x in xs:
        if x.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"pallas_gpu gmm needs bf16/f16 operands, got {x.dtype}")


def grouped_rows_kernel(group_acc, group_sizes, inputs, *, shape, tile, out_dtype, scratch=(),
                        band=8, interpret=False, tiles=1, prologue=None, epilogue=None,
                        out_shapes=None, name="gmm"):
    """Run the (M block, N block) program shared by the grouped matmuls that produce rows.

    `group_acc(g, mb, nb, in_refs, scratch_refs) -> [bm, bn] f32` computes M block mb of the
    rows against group g's weights for N block nb; this keeps, per group, only that group's rows
    (a row mask; each row belongs to one group) and stores the tile once. `inputs` are padded
    GMEM operands, `shape` = (M, N) padded to `tile` = (bm, bn); `band`: see `_banded`.

    Fused epilogues: with `tiles` > 1, `group_acc` returns that many tiles, each merged into its
    own [bm, bn] SMEM tile (out_dtype). `epilogue(tile_smems, in_refs, out_refs, scratch_refs,
    row0, nb)` then replaces the default store (tile 0 to out[row0:row0+bm, nb*bn:nb*bn+bn]) and
    issues its own TMA stores into `out_shapes` (ShapeDtypeStructs; the kernel returns a tuple).
    `prologue(in_refs, scratch_refs, row0, nb)` runs before the matmuls (e.g. to start TMA loads
    that the epilogue waits for). `name` names the kernel in profiles and ptxas's report.
    """
    bm, bn = tile
    num_m, num_n = shape[0] // bm, shape[1] // bn
    offsets = _offsets(group_sizes)
    first, last = _block_groups(offsets, num_m, bm)
    n_in = len(inputs)
    outs = list(out_shapes) if out_shapes is not None else [jax.ShapeDtypeStruct(shape, out_dtype)]
    n_out = len(outs)
    if epilogue is None and (tiles != 1 or out_shapes is not None):
        raise ValueError("grouped_rows_kernel: several tiles or outputs need an epilogue to store them")

    def body(off_ref, first_ref, last_ref, *refs):
        in_refs, out_refs = refs[:n_in], refs[n_in:n_in + n_out]
        smems, scratch_refs = refs[n_in + n_out:n_in + n_out + tiles], refs[n_in + n_out + tiles:]
        mb, nb = _banded(jax.lax.axis_index("t"), num_m, num_n, min(band, num_n))
        row0 = mb * bm
        g0, g1 = first_ref[mb], last_ref[mb]  # g0 < g1: group g0 holds row0 (non-empty)
        if prologue is not None:
            prologue(in_refs, scratch_refs, row0, nb)

        @pl.when(g0 >= g1)  # every row past the total
        def _():
            for o_smem in smems:
                o_smem[...] = jnp.zeros((bm, bn), out_dtype)

        def one_group(g, carry):
            start, end = off_ref[g], off_ref[g + 1]
            whole = (start <= row0) & (end >= row0 + bm)  # the common case: no merge

            @pl.when(end > start)
            def _():
                accs = group_acc(g, mb, nb, in_refs, scratch_refs)
                accs = tuple(accs) if tiles > 1 else (accs,)

                @pl.when(whole)
                def _():
                    for o_smem, acc in zip(smems, accs):
                        o_smem[...] = acc.astype(out_dtype)

                def keep():
                    rows = row0 + _row_iota((bm, bn))
                    return (rows >= start) & (rows < end)

                @pl.when(~whole & (g == g0))  # the first group: nothing to merge with yet
                def _():
                    for o_smem, acc in zip(smems, accs):
                        o_smem[...] = jnp.where(keep(), acc.astype(out_dtype), 0).astype(out_dtype)

                @pl.when(~whole & (g != g0))
                def _():
                    for o_smem, acc in zip(smems, accs):
                        o_smem[...] = jnp.where(keep(), acc.astype(out_dtype), o_smem[...])

            return carry

        _group_loop(g0, g1, one_group)
        plgpu.commit_smem()
        if epilogue is None:
            plgpu.copy_smem_to_gmem(smems[0], out_refs[0].at[pl.ds(row0, bm), pl.ds(nb * bn, bn)])
            plgpu.wait_smem_to_gmem(0)
        else:
            epilogue(smems, in_refs, out_refs, scratch_refs, row0, nb)

    kernel = plgpu.kernel(
        body,
        out_type=outs if out_shapes is not None else outs[0],
        scratch_types=[plgpu.SMEM((bm, bn), out_dtype)] * tiles + list(scratch),
        grid=(num_m * num_n,),  # 1-D: CUDA caps the y and z grid axes at 65535
        grid_names=("t",),
        kernel_name=name,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=_params(interpret),
    )
    return kernel(offsets, first, last, *inputs)


def group_products(lhs_ref, rhs_refs, g, mb, nb, *, tile, num_k, stages, transpose_rhs=False):
    """Tuple of [bm, bn] f32 tiles, lhs[M block mb] @ rhs[g][:, N block nb] for every rhs in
    `rhs_refs` ([G, K, N] each, or [G, N, K] with transpose_rhs): one K-pipeline that loads the
    lhs block once per step for all of them (one wgmma per rhs)."""
    bm, bn, bk = tile
    n = len(rhs_refs)

    def acc_scope(*acc_refs):
        def step(_, lhs_smem, *rhs_smems):
            for acc_ref, rhs_smem in zip(acc_refs, rhs_smems):
                plgpu.wgmma(acc_ref, lhs_smem, rhs_smem.transpose((1, 0)) if transpose_rhs else rhs_smem)
            plgpu.wgmma_wait(n)  # the previous step's products are done: its buffers can go

        rhs_block = (bn, bk) if transpose_rhs else (bk, bn)
        rhs_index = (lambda kk: (nb, kk)) if transpose_rhs else (lambda kk: (kk, nb))
        plgpu.emit_pipeline(
            step,
            grid=(num_k,),
            in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (mb, kk), delay_release=1)]
                     + [plgpu.BlockSpec(rhs_block, rhs_index, delay_release=1)] * n,
            max_concurrent_steps=stages,
        )(lhs_ref, *(r.at[g] for r in rhs_refs))
        plgpu.wgmma_wait(0)
        return tuple(acc_ref[...] for acc_ref in acc_refs)

    return pl.run_scoped(acc_scope, *[plgpu.ACC((bm, bn))] * n)


@lowered_once("transpose_rhs", "blocks", "interpret", "out_dtype")
def gmm(lhs, rhs, group_sizes, *, transpose_rhs=False, blocks=Blocks(), interpret=False,
        out_dtype=None):
    """lhs [M, K] x rhs [G, K, N] (or [G, N, K] with transpose_rhs) -> [M, N] by group."""
    if blocks.wgs == 2:
        from kernels.gmm import pallas_gpu_ws  # it builds on this module's helpers

        return pallas_gpu_ws.gmm(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs,
                                 blocks=blocks, interpret=interpret, out_dtype=out_dtype)
    _check_dtypes(lhs, rhs)
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    bm, bn, bk = blocks.bm, blocks.bn, blocks.bk
    lhs_p = _pad_to(_pad_to(lhs, 0, bm), 1, bk)
    rhs_p = _pad_to(_pad_to(rhs, 1, bn if transpose_rhs else bk), 2, bk if transpose_rhs else bn)
    mp, kp = lhs_p.shape
    np_ = rhs_p.shape[1] if transpose_rhs else rhs_p.shape[2]

    def group_acc(g, mb, nb, in_refs, scratch_refs):
        lhs_ref, rhs_ref = in_refs
        (acc,) = group_products(lhs_ref, (rhs_ref,), g, mb, nb, tile=(bm, bn, bk), num_k=kp // bk,
                                stages=blocks.stages, transpose_rhs=transpose_rhs)
        return acc

    out = grouped_rows_kernel(group_acc, group_sizes, (lhs_p, rhs_p), shape=(mp, np_),
                              tile=(bm, bn), out_dtype=out_dtype, band=blocks.band,
                              interpret=interpret)
    return out[:m, :n]


def _auto_splits(tiles: int, interpret: bool) -> int:
    """Row splits for tgmm: enough programs for two per SM when there are few output tiles
    (few experts and small widths, e.g. 8 experts x 256 x 256 is 32 tiles for 132 SMs)."""
    if interpret:
        return 1
    sms = getattr(jax.devices()[0], "core_count", None) or 132
    return 1 if tiles >= 2 * sms else min(16, -(-2 * sms // tiles))


@lowered_once("blocks", "interpret", "out_dtype", "splits")
def tgmm(lhs, dout, group_sizes, *, blocks=Blocks(), interpret=False, out_dtype=None,
         splits=None):
    """lhs [M, K], dout [M, N] -> [G, K, N], out[g] = lhs[rows_g]^T @ dout[rows_g].

    `splits` > 1 cuts every group's rows into that many contiguous parts, computed by separate
    programs into [splits, G, K, N] partials (out_dtype) that XLA sums in f32; None picks it
    from the tile count (`_auto_splits`)."""
    if blocks.wgs == 2:
        from kernels.gmm import pallas_gpu_ws

        return pallas_gpu_ws.tgmm(lhs, dout, group_sizes, blocks=blocks, interpret=interpret,
                                  out_dtype=out_dtype)
    _check_dtypes(lhs, dout)
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    m, k = lhs.shape
    n = dout.shape[1]
    g_count = group_sizes.shape[0]
    bm, bn, bk = blocks.bm, blocks.bn, blocks.bk
    lhs_p = _pad_to(_pad_to(lhs, 0, bm), 1, bk)
    dout_p = _pad_to(_pad_to(dout, 0, bm), 1, bn)
    kp, np_ = lhs_p.shape[1], dout_p.shape[1]
    num_k, num_n = kp // bk, np_ // bn
    tiles = num_k * num_n
    splits = splits or _auto_splits(g_count * tiles, interpret)
    offsets = _offsets(group_sizes)

    def body(off_ref, lhs_ref, dout_ref, out_ref, o_smem):
        # Group-major: the resident CTAs work on one group, whose rows then stay in L2.
        t = jax.lax.axis_index("t")
        g = t // (splits * tiles)
        sp = (t - g * (splits * tiles)) // tiles
        kb, nb = _banded(t - g * (splits * tiles) - sp * tiles, num_k, num_n,
                         min(blocks.band, num_n))
        start, end = off_ref[g], off_ref[g + 1]
        first_mb = start // bm
        group_steps = jnp.where(end > start, (end + bm - 1) // bm - first_mb, 0)
        chunk = (group_steps + splits - 1) // splits
        mb0 = first_mb + sp * chunk
        num_steps = jnp.clip(group_steps - sp * chunk, 0, chunk)

        @pl.when(num_steps <= 0)
        def _():
            o_smem[...] = jnp.zeros((bk, bn), out_dtype)

        @pl.when(num_steps > 0)
        def _():
            def acc_scope(acc_ref):
                def step(idx, lhs_smem, dout_smem):
                    row0 = (mb0 + idx[0]) * bm

                    @pl.when((row0 < start) | (row0 + bm > end))
                    def _():
                        rows = row0 + _row_iota((bm, bn))
                        keep = (rows >= start) & (rows < end)
                        dout_smem[...] = jnp.where(keep, dout_smem[...], 0).astype(dout_smem.dtype)
                        plgpu.commit_smem()

                    plgpu.wgmma(acc_ref, lhs_smem.transpose((1, 0)), dout_smem)
                    plgpu.wgmma_wait(1)

                plgpu.emit_pipeline(
                    step,
                    grid=(num_steps,),
                    in_specs=[
                        plgpu.BlockSpec((bm, bk), lambda i: (mb0 + i, kb), delay_release=1,
                                        transforms=_swizzled(bk, lhs.dtype)),
                        plgpu.BlockSpec((bm, bn), lambda i: (mb0 + i, nb), delay_release=1,
                                        transforms=_swizzled(bn, dout.dtype)),
                    ],
                    max_concurrent_steps=blocks.stages,
                )(lhs_ref, dout_ref)
                plgpu.wgmma_wait(0)
                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((bk, bn)))
            o_smem[...] = acc.astype(out_dtype)

        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            o_smem, out_ref.at[sp * g_count + g, pl.ds(kb * bk, bk), pl.ds(nb * bn, bn)])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((splits * g_count, kp, np_), out_dtype),
        scratch_types=[plgpu.SMEM((bk, bn), out_dtype)],
        grid=(g_count * splits * tiles,),
        grid_names=("t",),
        kernel_name="tgmm",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=_params(interpret),
    )
    out = kernel(offsets, lhs_p, dout_p)[:, :k, :n]
    if splits > 1:
        out = out.reshape(splits, g_count, k, n).astype(jnp.float32).sum(0).astype(out_dtype)
    return out


def split_blocks(blocks):
    """(forward, dlhs, drhs) tiles from one `Blocks` (used for all three) or a 3-tuple."""
    if isinstance(blocks, Blocks):
        return blocks, blocks, blocks
    fwd, dlhs, drhs = blocks
    return fwd, dlhs, drhs


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def gmm_vjp(lhs, rhs, group_sizes, blocks=Blocks(), interpret=False):
    """Differentiable gmm: dlhs = gmm(dout, rhs^T), drhs = tgmm(lhs, dout), both kernels.
    `blocks`: one `Blocks` or a (forward, dlhs, drhs) tuple, tuned per kernel."""
    return gmm(lhs, rhs, group_sizes, blocks=split_blocks(blocks)[0], interpret=interpret)


def _gmm_fwd(lhs, rhs, group_sizes, blocks, interpret):
    out = gmm(lhs, rhs, group_sizes, blocks=split_blocks(blocks)[0], interpret=interpret)
    return out, (lhs, rhs, group_sizes)


def _gmm_bwd(blocks, interpret, res, dout):
    lhs, rhs, group_sizes = res
    _, b_dlhs, b_drhs = split_blocks(blocks)
    dout = dout.astype(lhs.dtype)
    dlhs = gmm(dout, rhs, group_sizes, transpose_rhs=True, blocks=b_dlhs, interpret=interpret)
    drhs = tgmm(lhs, dout, group_sizes, blocks=b_drhs, interpret=interpret, out_dtype=rhs.dtype)
    return dlhs, drhs, np.zeros(group_sizes.shape, jax.dtypes.float0)


gmm_vjp.defvjp(_gmm_fwd, _gmm_bwd)
