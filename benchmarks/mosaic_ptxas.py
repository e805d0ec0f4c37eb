"""Registers, spills and code size of every Mosaic GPU kernel, from ptxas, at the benchmarks' shapes.

    JAX_PLATFORMS=cuda python benchmarks/mosaic_ptxas.py [--cases kda_fwd,kda_train,...] [--out J]

A kernel that spills registers to local memory (the warpgroup's f32 [64, 64] tiles are 32
registers per thread each) runs far below what its SMEM traffic allows; ptxas says so, but only
when asked. Each case compiles and runs the ops that launch our kernels (at the shapes of
`benchmarks/kda.py`, `benchmarks/short_conv.py` and `benchmarks/moe.py`) with
`MOSAIC_GPU_DUMP_PTXAS=1` and `MOSAIC_GPU_DUMP_TO` a temporary folder, where Mosaic GPU's compiler
writes ptxas's verbose report for each kernel; the reports are parsed into one row per compiled
kernel (registers per thread, spill stores and loads, stack frame, and whether ptxas serialized its
wgmmas for want of registers: its C7511 note, which makes overlapping products run one by one). The
JSON (default benchmarks/results/mosaic-ptxas-<time>.json) keeps the raw report too.

Each row also gives the kernel's machine code size (`sass_bytes`, 16 bytes an instruction), from
the PTX Mosaic GPU writes (MOSAIC_GPU_DUMP_PTX) assembled again with ptxas: a kernel of unrolled
straight-line code larger than the SM's instruction cache stalls on instruction fetch (the bf16
intra kernel at 146 KiB spent half its cycles so; Nsight Compute's "no instruction" stall).
Where CUDA's nvdisasm is found too, `sass_opcodes` counts that code's instructions by opcode
(HGMMA, MUFU, BAR, ...; static counts, a loop body once), to compare two forms of a kernel.

Needs a Hopper GPU: on any other device the kernels run interpreted or not at all, and the script
stops with that reason instead of writing an empty table. Or, on a machine without one:

    pip install jax-cuda12-pjrt==0.11.2 jax-cuda12-plugin==0.11.2   # + a ptxas on PATH (CUDA >= 12.8)
    python benchmarks/mosaic_ptxas.py --deviceless [--cases ...]

compiles each case ahead of time for an H200 (`H200_TARGET`, compute capability 9.0: sm_90a)
without running it: the same ptxas report, from the kernels traced as on a Hopper GPU
(`kernels.kda.hopper.assume_device_kind`). The CUDA plugin loads without a driver when
JAX_SKIP_CUDA_CONSTRAINTS_CHECK is set, which the flag does before jax is imported.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--deviceless" in sys.argv:  # the CUDA plugin beside the CPU backend, no driver needed
    os.environ.setdefault("JAX_PLATFORMS", "cpu,cuda")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import environment, markdown_table, write_json  # noqa: E402

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
# "(C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized due to ... in the
# function 'NAME'": ptxas waits for each wgmma before the next one issues (a kernel near the register
# limit with register operands or accumulators live across products), so products that were meant to
# overlap run one after another. Printed before the function's own lines.
_SERIALIZED = re.compile(r"\(C7511\).*serialized.*function '([^']+)'")


def parse_ptxas(text: str) -> list[dict]:
    """ptxas -v report -> [{function, arch, registers, stack_frame, spill_stores, spill_loads,
    wgmma_serialized}] in the order the entry functions were compiled (fields a report lacks stay
    None; wgmma_serialized: whether ptxas said it serialized the function's wgmmas)."""
    rows, serialized = [], set()
    for line in text.splitlines():
        if m := _SERIALIZED.search(line):
            serialized.add(m.group(1))
        elif m := _ENTRY.search(line):
            rows.append(dict(function=m.group(1), arch=m.group(2), registers=None, stack_frame=None,
                             spill_stores=None, spill_loads=None))
        elif rows and (m := _FRAME.search(line)):
            rows[-1].update(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif rows and (m := _USED.search(line)):
            rows[-1]["registers"] = int(m.group(1))
    for row in rows:
        row["wgmma_serialized"] = row["function"] in serialized
    return rows


def text_bytes(cubin: bytes) -> int:
    """Bytes of machine code in an ELF cubin: the sizes of its .text.* sections."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF file")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    entsize, count, names = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * entsize) for i in range(count)]
    strtab = sections[names][4]

    def name(off):
        return cubin[strtab + off:cubin.index(b"\0", strtab + off)].decode()

    return sum(sec[5] for sec in sections if name(sec[0]).startswith(".text."))


def cuda_tool(name: str) -> str | None:
    """Path of a CUDA toolkit program (ptxas, ncu): on PATH, else under MOSAIC_GPU_CUDA_ROOT or
    /usr/local/cuda; None if neither has it."""
    path = os.path.join(os.environ.get("MOSAIC_GPU_CUDA_ROOT", "/usr/local/cuda"), "bin", name)
    return shutil.which(name) or (path if os.path.exists(path) else None)


def sass_bytes(ptx_path: str, arch: str = "sm_90a") -> int | None:
    """Machine code bytes of one dumped PTX file, assembled again by ptxas (None without one);
    the cubin is left beside the PTX."""
    ptxas = cuda_tool("ptxas")
    if ptxas is None:
        return None
    cubin = ptx_path[:-4] + ".cubin"
    subprocess.run([ptxas, f"-arch={arch}", ptx_path, "-o", cubin], check=True, capture_output=True)
    with open(cubin, "rb") as f:
        return text_bytes(f.read())


def opcode_counts(sass: str) -> dict[str, int]:
    """nvdisasm's listing -> {opcode: static count}, opcodes without their modifiers (HGMMA, MUFU,
    FFMA, STS, ...), largest first. Static: a loop body counts once however often it runs."""
    counts: dict[str, int] = {}
    for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass):
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def sass_opcodes(cubin: str) -> dict[str, int] | None:
    """Static opcode counts of a cubin's machine code by nvdisasm (None without nvdisasm)."""
    nvdisasm = cuda_tool("nvdisasm")
    if nvdisasm is None or not os.path.exists(cubin):
        return None
    return opcode_counts(subprocess.run([nvdisasm, cubin], check=True, capture_output=True, text=True).stdout)


def _dump_index(path: str) -> int:
    return int(re.search(r"_(\d+)\.[a-z]+$", path).group(1))


def _kda_inputs(B, T, H, D):
    from kernels.kda.pallas_gpu_bench import inputs

    return inputs(B, T, H, D)


def _case_kda_fwd():
    """impl="pallas_gpu" forward at 8 x 4096 x 16 x 128: the default intra stage (XLA) and the state kernel."""
    from kernels.kda import kda

    args = _kda_inputs(8, 4096, 16, 128)
    return lambda *a: kda(*a, lower_bound=-5.0, impl="pallas_gpu")[0], args


def _case_kda_intra_bf16():
    """The bf16 intra-chunk kernel alone (`mosaic_intra_bf16.intra_bf16`, pallas_gpu's intra="mosaic_bf16")
    at 8 x 4096 x 16 x 128 with the bounded gate."""
    from kernels.kda import mosaic_intra_bf16

    q, k, v, g, beta = _kda_inputs(8, 4096, 16, 128)
    fn = lambda q, k, v, g, bt: mosaic_intra_bf16.intra_bf16(q, k, v, g, bt, scale=128 ** -0.5)  # noqa: E731
    return fn, (q, k, v, g, jnp.moveaxis(beta, 1, 2))


def _case_kda_train():
    """impl="chunk_mosaic" forward + backward at 8 x 4096 x 16 x 128: the two serial passes."""
    from kernels.kda import kda

    args = _kda_inputs(8, 4096, 16, 128)

    def loss(*a):
        return jnp.sum(kda(*a, lower_bound=-5.0, impl="chunk_mosaic")[0].astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2, 3, 4)), args


def _train_with(**settings):
    """`_case_kda_train` traced under these chunk settings."""
    from kernels.kda import chunk

    fn, args = _case_kda_train()

    def run(*a):
        with chunk.settings(**settings):
            return fn(*a)

    return run, args


def _case_kda_scores_bwd():
    """chunk_mosaic forward + backward with the scores-backward kernel (`scores_bwd=mosaic`)."""
    return _train_with(scores_bwd="mosaic")


def _case_kda_wy_bwd():
    """chunk_mosaic forward + backward with the WY pull-back kernel (`wy_bwd=mosaic`)."""
    return _train_with(wy_bwd="mosaic")


def _case_kda_wy_bwd_persistent():
    """The same with the WY kernel's persistent form (`wy_form=persistent`)."""
    return _train_with(wy_bwd="mosaic", wy_form="persistent")


def _case_kda_wy_bwd_state():
    """The same with the WY kernel also forming the state products (`wy_state=kernel`)."""
    return _train_with(wy_bwd="mosaic", wy_state="kernel")


def _case_kda_decode():
    """kda_step impl="pallas_gpu" for B = 64, H = 32, K = V = 128 (benchmarks/kda_decode.py's inputs)."""
    from benchmarks.kda_decode import _decode_inputs
    from kernels.kda import kda_step

    x = _decode_inputs(64, 32, 128, 128)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    args = (jnp.asarray(x["state"]), bf(x["q"]), bf(x["k"]), bf(x["v"]), jnp.asarray(x["g"]), jnp.asarray(x["beta"]))
    return lambda *a: kda_step(*a, impl="pallas_gpu"), args


def _case_short_conv():
    """The short convolution's tap-gradient kernel at 4 x 4096 x 2048 bf16, W = 4."""
    from kernels.short_conv import ops, pallas_gpu

    keys = jax.random.split(jax.random.key(0), 3)
    B, T, C, W = 4, 4096, 2048, 4
    x, dy = (jax.random.normal(k, (B, T, C), jnp.bfloat16) for k in keys[:2])
    w = jax.random.normal(keys[2], (W, C), jnp.float32)
    masks = ops.tap_masks(None, B, T, W)
    return lambda *a: pallas_gpu.tap_grads(*a), (x, dy, w, masks)


def _case_gmm():
    """gmm forward, its input gradient and tgmm at the k3_small expert shapes (65536 x 256 x 224, 8 experts)."""
    from kernels.gmm import ops as gmm_ops

    keys = jax.random.split(jax.random.key(0), 3)
    M, K, N, G = 65536, 256, 224, 8
    x = jax.random.normal(keys[0], (M, K), jnp.bfloat16)
    w = jax.random.normal(keys[1], (G, K, N), jnp.bfloat16)
    sizes = jnp.full((G,), M // G, jnp.int32)

    def loss(x, w):
        return jnp.sum(gmm_ops.gmm(x, w, sizes, impl="pallas_gpu").astype(jnp.float32) ** 2)

    return jax.grad(loss, argnums=(0, 1)), (x, w)


def _expert_ffn(fusion):
    """`glu_ffn` forward+backward with `fusion` at the k3_small expert shapes (65536 rows, D = 256,
    F = 224, 8 experts, SiTU-GLU)."""
    from kernels.gmm import glu

    keys = jax.random.split(jax.random.key(0), 4)
    M, D, F, G = 65536, 256, 224, 8
    x = jax.random.normal(keys[0], (M, D), jnp.bfloat16)
    wg, wu = (jax.random.normal(k, (G, D, F), jnp.bfloat16) for k in keys[1:3])
    wd = jax.random.normal(keys[3], (G, F, D), jnp.bfloat16)
    sizes = jnp.full((G,), M // G, jnp.int32)

    def loss(*a):
        return jnp.sum(glu.glu_ffn(*a, sizes, kind="situ", impl="pallas_gpu", fusion=fusion).astype(jnp.float32))

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), (x, wg, wu, wd)


def _case_gmm_ffn():
    """The whole-FFN kernels (`glu_ffn`, fusion="ffn": forward kernel, backward rows kernel, two
    tgmm) at the k3_small expert shapes."""
    return _expert_ffn("ffn")


def _case_gmm_glu():
    """The fused gate/up kernels with the down projection's grouped matmuls (`glu_ffn`,
    fusion="glu", what k3_small runs) at the k3_small expert shapes."""
    return _expert_ffn("glu")


CASES = dict(kda_fwd=_case_kda_fwd, kda_intra_bf16=_case_kda_intra_bf16, kda_train=_case_kda_train,
             kda_scores_bwd=_case_kda_scores_bwd, kda_wy_bwd=_case_kda_wy_bwd,
             kda_wy_bwd_persistent=_case_kda_wy_bwd_persistent, kda_wy_bwd_state=_case_kda_wy_bwd_state,
             kda_decode=_case_kda_decode,
             short_conv=_case_short_conv, gmm=_case_gmm, gmm_glu=_case_gmm_glu, gmm_ffn=_case_gmm_ffn)


# An H200 as XLA's GPU compiler describes a device (GpuTargetConfig), for --deviceless.
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024  threads_per_warp: 32  shared_memory_per_block: 49152
  shared_memory_per_core: 233472  threads_per_core_limit: 2048  core_count: 132  fpus_per_core: 128
  block_dim_limit_x: 2147483647  block_dim_limit_y: 65535  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000  l2_cache_size: 52428800  clock_rate_ghz: 1.98
  device_memory_size: 150754820096  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }  registers_per_core_limit: 65536  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA H200"
"""


def deviceless_devices(n: int = 1) -> list:
    """n H200s of one host described for an ahead-of-time compile (no GPU needed): the CUDA PJRT
    plugin's topology with `H200_TARGET`."""
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(platform="cuda", target_config=H200_TARGET,
                                                 topology=f"1x1x{n}").devices)
    except (NotImplementedError, RuntimeError, ValueError) as e:
        raise SystemExit(f"--deviceless needs the CUDA PJRT plugin (pip install jax-cuda12-pjrt==0.11.2 "
                         f"jax-cuda12-plugin==0.11.2): {type(e).__name__}: {e}") from None


def deviceless_sharding():
    """A one-device sharding on an H200 compiled for ahead of time (no GPU needed)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    return NamedSharding(Mesh(deviceless_devices(1), ("d",)), PartitionSpec())


def run_case(name: str, sharding=None) -> dict:
    """Compile and run case `name` once with ptxas's report and the PTX dumped; its kernels' rows.
    With a `sharding` (`deviceless_sharding`) compile it for that sharding's device without
    running it."""
    fn, args = CASES[name]()
    flags = dict(MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_PTX="1")
    with tempfile.TemporaryDirectory() as dump:
        os.environ.update(flags, MOSAIC_GPU_DUMP_TO=dump)
        try:
            if sharding is None:
                jax.block_until_ready(jax.jit(fn)(*args))
            else:
                spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
                jax.jit(fn).lower(*spec).compile()
        finally:
            for key in (*flags, "MOSAIC_GPU_DUMP_TO"):
                os.environ.pop(key, None)
        reports = sorted(glob.glob(os.path.join(dump, "*.ptxas")), key=_dump_index)
        text = "".join(open(r).read() for r in reports)
        kernels = parse_ptxas(text)
        ptx = sorted(glob.glob(os.path.join(dump, "*.ptx")), key=_dump_index)
        if len(ptx) == len(kernels):  # one PTX file per compiled kernel, in the same order
            for k, path in zip(kernels, ptx):
                k["sass_bytes"] = sass_bytes(path, k["arch"])
                k["sass_opcodes"] = sass_opcodes(path[:-4] + ".cubin")
    return dict(case=name, doc=CASES[name].__doc__, kernels=kernels, report=text)


def markdown(results: list[dict]) -> str:
    rows = []
    for r in results:
        for i, k in enumerate(r["kernels"]):
            rows.append([r["case"], f"{i}: {k['function']}", str(k["registers"]), str(k["spill_stores"]),
                         str(k["spill_loads"]), str(k["stack_frame"]), str(k.get("sass_bytes")),
                         "yes" if k.get("wgmma_serialized") else "no"])
        if not r["kernels"]:
            why = r.get("error") or f"none among {len(r.get('report', ''))} captured characters: kernels cached or not compiled here"
            rows.append([r["case"], f"no ptxas report ({why})", "", "", "", "", "", ""])
    return markdown_table(["case", "kernel", "registers", "spill stores B", "spill loads B", "stack frame B", "SASS B",
                           "wgmma serialized"], rows)


def run_cases(parser, cases: str, run, markdown_of, tool: str, why: str) -> list[dict]:
    """`run(name)` for each name of comma-separated `cases` (each checked against CASES by the
    `parser`), on a Hopper GPU only (`why` says what the tool cannot do elsewhere); a failing case
    is recorded with its error and the others still run; each case's table is printed."""
    names = [n for n in cases.split(",") if n]
    for n in names:
        if n not in CASES:
            parser.error(f"--cases: {n!r} is not one of {list(CASES)}")
    from kernels.kda.hopper import device_kind

    if device_kind() != "hopper":
        raise SystemExit(f"{tool} needs a Hopper GPU: {why} (device kind {device_kind()!r})")
    results = []
    for n in names:
        try:
            results.append(run(n))
        except Exception as e:  # noqa: BLE001 - a failing case is recorded, the others still run
            results.append(dict(case=n, doc=CASES[n].__doc__, kernels=[], error=f"{type(e).__name__}: {e}"[:500]))
        print(markdown_of(results[-1:]), flush=True)
    return results


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {list(CASES)}")
    p.add_argument("--out", help="JSON path (default benchmarks/results/mosaic-ptxas-<time>.json)")
    p.add_argument("--kda_settings", default="",
                   help="chunk.settings for every case, as benchmarks/kda.py takes them: e.g. block_v=32")
    p.add_argument("--deviceless", action="store_true",
                   help="compile for an H200 ahead of time instead of running on this machine's GPU")
    a = p.parse_args(argv)
    from benchmarks.kda import chunk_settings
    from kernels.kda import chunk

    try:
        settings = chunk_settings(a.kda_settings)
    except ValueError as e:
        p.error(f"--kda_settings: {e}")
    record = dict(env=environment(), kda_settings=settings)
    with chunk.settings(**settings):
        results = _run(p, a, record)
    path = write_json(dict(record, results=results), a.out, "mosaic-ptxas")
    print(markdown(results) + f"\nwrote {path}", flush=True)
    return results


def _run(p, a, record) -> list[dict]:
    if a.deviceless:
        from kernels.kda.hopper import assume_device_kind

        sharding = deviceless_sharding()
        record["target"] = "NVIDIA H200 (sm_90a), compiled ahead of time without a GPU (--deviceless)"
        with assume_device_kind("hopper"):
            results = run_cases(p, a.cases, lambda n: run_case(n, sharding), markdown, "mosaic_ptxas", "")
    else:
        results = run_cases(p, a.cases, run_case, markdown, "mosaic_ptxas", "elsewhere no kernel is compiled")
    return results


if __name__ == "__main__":
    main()
