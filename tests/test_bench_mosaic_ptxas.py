"""benchmarks/mosaic_ptxas.py: the ptxas report parser, the stdout capture at the descriptor
level, and the refusal to run where no kernel is compiled."""

import importlib.util
import os

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "mosaic_ptxas", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "mosaic_ptxas.py"))
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)

REPORT = """\
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
        dict(function="intra_kernel", arch="sm_90a", registers=168, stack_frame=96, spill_stores=120, spill_loads=88),
        dict(function="state_kernel", arch="sm_90a", registers=90, stack_frame=0, spill_stores=0, spill_loads=0),
    ]
    assert bench.parse_ptxas("no report here\n") == []
    md = bench.markdown([dict(case="kda_fwd", kernels=rows), dict(case="gmm", kernels=[], error="boom")])
    assert "| kda_fwd | 0: intra_kernel | 168 | 120 | 88 | 96 |" in md and "boom" in md


def test_capture_reads_what_is_written_to_descriptor_one(capsys):
    with capsys.disabled():
        with bench.captured_fd_stdout() as text:
            os.write(1, b"ptxas info    : Used 7 registers\n")
    assert text == ["ptxas info    : Used 7 registers\n"]


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
