"""Grouped matmul on Hopper, warp-specialized and persistent (Pallas Mosaic GPU).

The layout and group handling are those of `pallas_gpu.gmm` (rows sorted by group; one output
tile per (M block, N block), recomputed for every group that overlaps its rows and merged with a
row mask). What changes is how the tile is computed, after the structure of fast Hopper GEMMs:

- a CTA tile of bm x bn rows/columns is shared by two compute warpgroups (bm x bn/2 each, a
  128 x 128 f32 accumulator = 128 registers per thread at the default 128 x 256), fed by a third
  warpgroup that only issues TMA loads (`emit_pipeline_warp_specialized`), so loads, the two
  wgmma streams and the epilogue overlap;
- one CTA per SM walks the tiles (`nd_loop` over the SMs), in the banded order of
  `pallas_gpu._banded`, so the next tile's loads start while the last one is being stored;
- operand tiles use the 128-byte swizzle wgmma reads without bank conflicts.
Shared memory: stages x (bm*bk + bk*bn) + bm*bn 16-bit values for gmm (3 stages at 128 x 256 x
64 fit), stages x bm*(bk + bn) + bk*bn for tgmm (3 stages at 64 x 256 x 128).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.gmm.pallas_gpu import (
    Blocks, _banded, _block_groups, _check_dtypes, _offsets, _pad_to, _params, _row_iota)

NUM_COMPUTE_WGS = 2
MEMORY_REGISTERS = 40  # the TMA warpgroup gives its registers to the compute warpgroups


def _transforms(minor: int, dtype):
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits)
    return (plgpu.TilingTransform((8, 8 * swizzle // bits)), plgpu.SwizzleTransform(swizzle))


def _num_sms(interpret: bool) -> int:
    if interpret:
        return 2
    return getattr(jax.devices()[0], "core_count", None) or 132


def check_blocks(blocks: Blocks):
    if blocks.bn % (64 * NUM_COMPUTE_WGS):
        raise ValueError(f"warp-specialized gmm splits bn={blocks.bn} over "
                         f"{NUM_COMPUTE_WGS} warpgroups: it must be a multiple of "
                         f"{64 * NUM_COMPUTE_WGS}")


def gmm(lhs, rhs, group_sizes, *, transpose_rhs=False, blocks=Blocks(bn=256, stages=3),
        interpret=False, out_dtype=None):
    """lhs [M, K] x rhs [G, K, N] (or [G, N, K] with transpose_rhs) -> [M, N] by group."""
    _check_dtypes(lhs, rhs)
    check_blocks(blocks)
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    bm, bn, bk = blocks.bm, blocks.bn, blocks.bk
    wn = bn // NUM_COMPUTE_WGS
    lhs_p = _pad_to(_pad_to(lhs, 0, bm), 1, bk)
    rhs_p = _pad_to(_pad_to(rhs, 1, bn if transpose_rhs else bk), 2, bk if transpose_rhs else bn)
    mp, kp = lhs_p.shape
    np_ = rhs_p.shape[1] if transpose_rhs else rhs_p.shape[2]
    num_m, num_n, num_k = mp // bm, np_ // bn, kp // bk
    band = min(blocks.band, num_n)
    # Chained: the TMA warpgroup runs on into the next tile's (or group's) loads while the
    # compute warpgroups finish and store the last one; needs num_k % stages == 0.
    chain = blocks.chain and num_k % blocks.stages == 0
    offsets = _offsets(group_sizes)
    first, last = _block_groups(offsets, num_m, bm)
    lhs_tf = _transforms(bk, lhs.dtype)
    rhs_tf = _transforms(bk if transpose_rhs else bn, rhs.dtype)
    out_tf = _transforms(wn, out_dtype)

    def make_pipeline(mma_body, compute_context, state=None):
        return plgpu.emit_pipeline_warp_specialized(
            mma_body,
            grid=(num_k,),
            memory_registers=MEMORY_REGISTERS,
            pipeline_state=state,
            in_specs=[
                plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), transforms=lhs_tf,
                                delay_release=0),
                plgpu.BlockSpec((bn, bk) if transpose_rhs else (bk, bn),
                                (lambda kk: (0, kk)) if transpose_rhs else (lambda kk: (kk, 0)),
                                transforms=rhs_tf, delay_release=0),
            ],
            wg_axis="wg",
            num_compute_wgs=NUM_COMPUTE_WGS,
            max_concurrent_steps=blocks.stages,
            compute_context=compute_context,
        )

    def rhs_view(rhs_ref, g, nb):
        cols = pl.ds(nb * bn, bn)
        return rhs_ref.at[g, cols, :] if transpose_rhs else rhs_ref.at[g, :, cols]

    def body(off_ref, first_ref, last_ref, lhs_ref, rhs_ref, out_ref):
        ignore = lambda *_, **__: None  # noqa: E731

        @functools.partial(
            pl.run_scoped,
            allocs=make_pipeline(ignore, ignore).get_allocations(
                lhs_ref.at[pl.ds(0, bm), :], rhs_view(rhs_ref, 0, 0)),
            o_smem=plgpu.SMEM((NUM_COMPUTE_WGS, bm, wn), out_dtype, transforms=out_tf),
            collective_axes="wg",
        )
        def scope(allocs, o_smem):
            wg = jax.lax.axis_index("wg")
            is_compute = wg < NUM_COMPUTE_WGS

            @plgpu.nd_loop((num_m * num_n,), collective_axes="sm", init_carry=jnp.int32(0))
            def tile_loop(info, carry):  # carry: 1 once this SM has run a pipeline
                mb, nb = _banded(info.index[0], num_m, num_n, band)
                row0 = mb * bm

                g0, g1 = first_ref[mb], last_ref[mb]  # g0 < g1: group g0 holds row0

                @pl.when(is_compute)
                def _():
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # o_smem is free again

                @pl.when(is_compute & (g0 >= g1))  # every row past the total
                def _():
                    o_smem[wg] = jnp.zeros((bm, wn), out_dtype)

                def one_group(g, started):
                    start, end = off_ref[g], off_ref[g + 1]

                    def compute_context(eval_pipeline):
                        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, wn)))
                        def _(acc_ref):
                            eval_pipeline(acc_ref)
                            plgpu.wgmma_wait(0)
                            acc = acc_ref[...].astype(out_dtype)
                            whole = (start <= row0) & (end >= row0 + bm)

                            def keep():
                                rows = row0 + _row_iota((bm, wn))
                                return (rows >= start) & (rows < end)

                            @pl.when(whole)
                            def _():
                                o_smem[wg] = acc

                            @pl.when(~whole & (g == g0))
                            def _():
                                o_smem[wg] = jnp.where(keep(), acc, 0).astype(out_dtype)

                            @pl.when(~whole & (g != g0))
                            def _():
                                o_smem[wg] = jnp.where(keep(), acc, o_smem[wg])

                    def mma_body(_, lhs_smem, rhs_smem, acc_ref):
                        wcols = pl.ds(wg * wn, wn)
                        b = (rhs_smem.at[wcols, :].transpose((1, 0)) if transpose_rhs
                             else rhs_smem.at[:, wcols])
                        plgpu.wgmma(acc_ref, lhs_smem, b)
                        plgpu.wgmma_wait(0)
                        return acc_ref

                    @pl.when(end > start)
                    def _():
                        state = None
                        if chain:
                            state = jnp.where(started == 0, plgpu.PipelinePipeline.START,
                                              plgpu.PipelinePipeline.STEADY).astype(jnp.int32)
                        make_pipeline(mma_body, compute_context, state)(
                            lhs_ref.at[pl.ds(row0, bm), :], rhs_view(rhs_ref, g, nb),
                            allocations=allocs)

                    return jnp.where(end > start, 1, started)

                # Counts from 0, not g0, as `pallas_gpu._group_loop` does (which has no carry):
                # inside shard_map g0, read from a ref, carries the mesh's varying axes and the
                # loop's own arithmetic does not, so a counter started at g0 would change type.
                # The carry is computed, never a raw ref read: it keeps one type throughout.
                carry = jax.lax.fori_loop(0, g1 - g0, lambda j, c: one_group(g0 + j, c), carry)

                @pl.when(is_compute)
                def _():
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(
                        o_smem.at[wg], out_ref.at[pl.ds(row0, bm), pl.ds(nb * bn + wg * wn, wn)])

                return carry

            if chain:
                # What a STOP pipeline would do (the last call is not known in advance): the
                # TMA warpgroup observes the consumption of the last `stages` slots.
                @pl.when((wg == NUM_COMPUTE_WGS) & (tile_loop == 1))
                def _():
                    for slot in range(blocks.stages):
                        for barrier in allocs["flat_consumed_barrier_refs"]:
                            plgpu.barrier_wait(barrier.at[slot])

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=(_num_sms(interpret),),
        grid_names=("sm",),
        num_threads=NUM_COMPUTE_WGS + 1,
        thread_name="wg",
        kernel_name="gmm_ws",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=_params(interpret),
    )
    return kernel(offsets, first, last, lhs_p, rhs_p)[:m, :n]


def tgmm(lhs, dout, group_sizes, *, blocks=Blocks(bm=64, bn=256, bk=128, stages=3),
         interpret=False, out_dtype=None):
    """lhs [M, K], dout [M, N] -> [G, K, N], out[g] = lhs[rows_g]^T @ dout[rows_g].

    Persistent over (group, K block, N block) tiles, group-major; the [bk, bn] output tile is
    split over the two compute warpgroups along N, and each masks the rows of its half of the
    `dout` tile that lie outside the group (boundary M blocks only) before its wgmma."""
    _check_dtypes(lhs, dout)
    check_blocks(blocks)
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    m, k = lhs.shape
    n = dout.shape[1]
    g_count = group_sizes.shape[0]
    bm, bn, bk = blocks.bm, blocks.bn, blocks.bk
    wn = bn // NUM_COMPUTE_WGS
    lhs_p = _pad_to(_pad_to(lhs, 0, bm), 1, bk)
    dout_p = _pad_to(_pad_to(dout, 0, bm), 1, bn)
    kp, np_ = lhs_p.shape[1], dout_p.shape[1]
    num_k, num_n = kp // bk, np_ // bn
    band = min(blocks.band, num_n)
    offsets = _offsets(group_sizes)
    lhs_tf = _transforms(bk, lhs.dtype)
    dout_tf = _transforms(bn, dout.dtype)
    out_tf = _transforms(wn, out_dtype)

    def make_pipeline(mma_body, compute_context, num_steps, mb0):
        return plgpu.emit_pipeline_warp_specialized(
            mma_body,
            grid=(num_steps,),
            memory_registers=MEMORY_REGISTERS,
            in_specs=[
                plgpu.BlockSpec((bm, bk), lambda i: (mb0 + i, 0), transforms=lhs_tf),
                plgpu.BlockSpec((bm, bn), lambda i: (mb0 + i, 0), transforms=dout_tf),
            ],
            wg_axis="wg",
            num_compute_wgs=NUM_COMPUTE_WGS,
            max_concurrent_steps=blocks.stages,
            compute_context=compute_context,
        )

    def body(off_ref, lhs_ref, dout_ref, out_ref):
        ignore = lambda *_, **__: None  # noqa: E731

        @functools.partial(
            pl.run_scoped,
            # a grid of `stages` steps so that the allocation holds every pipeline slot
            allocs=make_pipeline(ignore, ignore, blocks.stages, 0).get_allocations(
                lhs_ref.at[:, pl.ds(0, bk)], dout_ref.at[:, pl.ds(0, bn)]),
            o_smem=plgpu.SMEM((NUM_COMPUTE_WGS, bk, wn), out_dtype, transforms=out_tf),
            collective_axes="wg",
        )
        def scope(allocs, o_smem):
            wg = jax.lax.axis_index("wg")
            is_compute = wg < NUM_COMPUTE_WGS

            @plgpu.nd_loop((g_count * num_k * num_n,), collective_axes="sm")
            def tile_loop(info):
                t = info.index[0]
                g = t // (num_k * num_n)
                kb, nb = _banded(t - g * (num_k * num_n), num_k, num_n, band)
                start, end = off_ref[g], off_ref[g + 1]
                mb0 = start // bm
                num_steps = (end + bm - 1) // bm - mb0

                @pl.when(is_compute)
                def _():
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    o_smem[wg] = jnp.zeros((bk, wn), out_dtype)

                def compute_context(eval_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bk, wn)))
                    def _(acc_ref):
                        eval_pipeline(acc_ref)
                        plgpu.wgmma_wait(0)
                        o_smem[wg] = acc_ref[...].astype(out_dtype)

                def mma_body(idx, lhs_smem, dout_smem, acc_ref):
                    row0 = (mb0 + idx[0]) * bm
                    half = dout_smem.at[:, pl.ds(wg * wn, wn)]

                    @pl.when((row0 < start) | (row0 + bm > end))
                    def _():
                        rows = row0 + _row_iota((bm, wn))
                        keep = (rows >= start) & (rows < end)
                        half[...] = jnp.where(keep, half[...], 0).astype(half.dtype)
                        plgpu.commit_smem()

                    plgpu.wgmma(acc_ref, lhs_smem.transpose((1, 0)), half)
                    plgpu.wgmma_wait(0)
                    return acc_ref

                @pl.when(end > start)
                def _():
                    make_pipeline(mma_body, compute_context, num_steps, mb0)(
                        lhs_ref.at[:, pl.ds(kb * bk, bk)], dout_ref.at[:, pl.ds(nb * bn, bn)],
                        allocations=allocs)

                @pl.when(is_compute)
                def _():
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(
                        o_smem.at[wg],
                        out_ref.at[g, pl.ds(kb * bk, bk), pl.ds(nb * bn + wg * wn, wn)])

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((g_count, kp, np_), out_dtype),
        grid=(_num_sms(interpret),),
        grid_names=("sm",),
        num_threads=NUM_COMPUTE_WGS + 1,
        thread_name="wg",
        kernel_name="tgmm_ws",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=_params(interpret),
    )
    return kernel(offsets, lhs_p, dout_p)[:, :k, :n]
