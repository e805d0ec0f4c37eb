"""How the CPU suite compiles, shared by the in-process tests (conftest) and the train.py /
eval.py / sweep.py processes tests start.

The suite is dominated by XLA compiles of tiny programs: LLVM's -O0 cuts them by about a third
(tests/test_remat.py 73 -> 50 s on 2 cores) for slightly slower execution (the 400-step MQAR
training test 50 -> 57 s). Only the CPU backend's code generation changes; the values the tests
compare are computed by the same XLA graphs.
"""

import os

CPU_O0_FLAG = "--xla_backend_optimization_level=0"


def one_cpu_process_env(**extra) -> dict:
    """Environment of a child process on one CPU device (not the conftest's 8 fake ones),
    compiled at -O0 as the in-process tests are; `extra` adds or replaces variables."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": CPU_O0_FLAG, **extra}
