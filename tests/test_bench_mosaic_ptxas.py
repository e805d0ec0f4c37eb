"""benchmarks/mosaic_ptxas.py: the ptxas report parser, the machine code size of a cubin, and
the refusal to run where no kernel is compiled."""

import importlib.util
import os
import struct

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "mosaic_ptxas", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "mosaic_ptxas.py"))
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)

REPORT = """\
ptxas info    : (C7517) warpgroup.wait is injected in around line 1338 by compiler to allow use of registers defined by GMMA in function 'state_kernel'
ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the wgmma pipeline in the function 'state_kernel'
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'intra_kernel' for 'sm_90a'
ptxas info    : Function properties for intra_kernel
    96 bytes stack frame, 120 bytes spill stores, 88 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 528 bytes cmem[0]
ptxas info    : Compiling entry function 'state_kernel' for 'sm_90a'
ptxas info    : Function properties for state_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 90 registers, used 1 barriers, 528 bytes cmem[0]
"""


def test_parse_ptxas_rows_in_compile_order():
    rows = bench.parse_ptxas(REPORT)
    assert rows == [
        dict(function="intra_kernel", arch="sm_90a", registers=168, stack_frame=96, spill_stores=120, spill_loads=88,
             wgmma_serialized=False),
        dict(function="state_kernel", arch="sm_90a", registers=90, stack_frame=0, spill_stores=0, spill_loads=0,
             wgmma_serialized=True),
    ]
    assert bench.parse_ptxas("no report here\n") == []
    md = bench.markdown([dict(case="kda_fwd", kernels=rows), dict(case="gmm", kernels=[], error="boom")])
    assert "| kda_fwd | 0: intra_kernel | 168 | 120 | 88 | 96 | None | no |" in md and "boom" in md
    assert "| kda_fwd | 1: state_kernel | 90 | 0 | 0 | 0 | None | yes |" in md


def _elf(sections):
    """A minimal 64-bit ELF file: (name, size) sections after a null one, names in .shstrtab."""
    names = b"\0.shstrtab\0" + b"".join(n.encode() + b"\0" for n, _ in sections)
    offsets, at = [], 11
    for n, _ in sections:
        offsets.append(at)
        at += len(n) + 1
    shoff = 64 + len(names)
    header = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9) + struct.pack("<HHIQQQIHHHHHH", 1, 190, 1, 0, 0, shoff, 0,
                                                                       64, 0, 0, 64, len(sections) + 2, 1)
    sh = lambda name, typ, off, size: struct.pack("<IIQQQQIIQQ", name, typ, 0, 0, off, size, 0, 0, 1, 0)  # noqa: E731
    table = sh(0, 0, 0, 0) + sh(1, 3, 64, len(names)) + b"".join(sh(o, 1, 0, size) for o, (_, size) in zip(offsets, sections))
    return header + names + table


def test_text_bytes_sums_the_code_sections():
    elf = _elf([(".text.intra_kernel", 149248), (".nv.shared.intra_kernel", 4096), (".text.state_kernel", 16512)])
    assert bench.text_bytes(elf) == 149248 + 16512
    assert bench.text_bytes(_elf([(".nv.info", 64)])) == 0
    with pytest.raises(ValueError, match="ELF"):
        bench.text_bytes(b"not an elf file at all, long enough for the header fields")


def test_sass_bytes_of_a_small_kernel(tmp_path):
    """ptxas assembles a PTX kernel of known length; its code is a whole number of 16-byte
    instructions and grows with the PTX (skipped where no ptxas is installed)."""
    if bench.cuda_tool("ptxas") is None:
        pytest.skip("no ptxas here")

    def kernel(n):
        body = "".join(f"  add.f32 %f1, %f1, 0f3F800000;\n  st.global.f32 [%rd1+{4 * i}], %f1;\n" for i in range(n))
        return (".version 8.0\n.target sm_90a\n.address_size 64\n.visible .entry k(.param .u64 p)\n{\n"
                "  .reg .f32 %f<2>;\n  .reg .b64 %rd<2>;\n  ld.param.u64 %rd1, [p];\n  mov.f32 %f1, 0f00000000;\n"
                + body + "  ret;\n}\n")

    sizes = []
    for n in (4, 64):
        path = tmp_path / f"k{n}.ptx"
        path.write_text(kernel(n))
        sizes.append(bench.sass_bytes(str(path)))
    assert all(s % 16 == 0 for s in sizes) and sizes[1] - sizes[0] >= 16 * 60


SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
        /*0010*/                   MUFU.EX2 R3, R2 ;                      /* 0x0000000200037308 */
        /*0020*/              @!P0 MUFU.EX2 R4, R2 ;
        /*0030*/               @P1 HGMMA.64x16x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0040*/                   FFMA R5, R3, R4, R5 ;
        /*0050*/             @UP0 FFMA R6, R3, R4, R6 ;
        /*0060*/                   EXIT ;
"""


def test_opcode_counts_drop_modifiers_and_predicates():
    assert bench.opcode_counts(SASS) == {"MUFU": 2, "FFMA": 2, "LDC": 1, "HGMMA": 1, "EXIT": 1}
    assert list(bench.opcode_counts(SASS))[:2] == ["MUFU", "FFMA"]
    assert bench.opcode_counts("no listing") == {}
    assert bench.sass_opcodes("/nonexistent.cubin") is None


def test_refuses_without_a_hopper_gpu_and_unknown_cases():
    with pytest.raises(SystemExit, match="Hopper GPU"):
        bench.main(["--cases", "kda_fwd"])
    with pytest.raises(SystemExit):
        bench.main(["--cases", "kda_everything"])


def test_assume_device_kind_routes_the_kernels_and_restores():
    """Under assume_device_kind("hopper") the kernels' dispatch sees a Hopper GPU (no interpreter,
    the Mosaic impls for "auto"); afterwards this machine's kind is back; unknown kinds raise."""
    from kernels.gmm import ops as gmm_ops
    from kernels.kda import hopper

    here = hopper.device_kind()
    assert here == "cpu" and gmm_ops._interpret()
    with hopper.assume_device_kind("hopper"):
        assert hopper.device_kind() == "hopper"
        assert hopper.unsupported_reason(128, 128, "bfloat16", interpret=False) is None
        assert gmm_ops.resolve_impl("auto", "bfloat16", "bfloat16") == "pallas_gpu" and not gmm_ops._interpret()
    assert hopper.device_kind() == here and gmm_ops.resolve_impl("auto", "bfloat16", "bfloat16") == "ragged_dot"
    from kernels.kda import chunk, chunk_intra

    with chunk.settings(scores_bwd="mosaic"):  # the kernel is only refused where it cannot compile
        with hopper.assume_device_kind("hopper"):
            assert chunk_intra._kernel_scores_bwd("bfloat16", 128)
        with pytest.raises(ValueError, match="compiles a Mosaic GPU kernel, but the backend is 'cpu'"):
            chunk_intra._kernel_scores_bwd("bfloat16", 128)
    with pytest.raises(ValueError, match="expected one of"):
        with hopper.assume_device_kind("ampere"):
            pass


def test_settings_are_checked_and_deviceless_needs_the_plugin():
    with pytest.raises(SystemExit):
        bench.main(["--cases", "kda_train", "--kda_settings", "block_v=48"])
    if importlib.util.find_spec("jax_plugins") and importlib.util.find_spec("jax_plugins.xla_cuda12"):
        pytest.skip("the CUDA plugin is installed here: --deviceless would compile")
    with pytest.raises(SystemExit, match="CUDA PJRT plugin"):
        bench.main(["--cases", "kda_train", "--deviceless"])
