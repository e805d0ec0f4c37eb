"""`lowered_once`: kernel launchers as jits whose settings are static arguments.

A model calls the same kernel at the same shapes once per layer. Called plainly inside the
step's jit, each call is traced and lowered again, and a Mosaic GPU kernel's lowering takes a
few tenths of a second of one CPU core (0.2 to 0.4 s on 2 cores for the MoE and KDA kernels), so
a deep model spends tens of seconds lowering copies of one kernel. As a jit with its settings
static, the calls of one step share one trace and one lowering. Everything a launcher reads
while tracing must then be among its arguments, or a later call under other settings would reuse
the first trace: module settings (tile widths, issue orders) are read by a thin wrapper and passed
in as static arguments; the profiler's state (`kernels.profiling`, which every Mosaic kernel's
compiler parameters read) is part of every launcher's key here.

Inside `jax.shard_map` the outputs carry the mesh axes the inputs vary over (`kernels.vma`).

Calls with `interpret=True` (the Mosaic GPU interpreter, CPU tests) run the launcher plainly:
the interpreter's callbacks dispatch JAX operations of their own, and inside an eagerly
dispatched jit they can wait on work the caller queued behind it (a deadlock seen on CPU).
"""

from __future__ import annotations

import functools

import jax

from kernels import profiling, vma


def lowered_once(*static_argnames: str):
    """Decorator: `jax.jit` with these keyword arguments static (each must be hashable) and the
    profiler's state, except for calls with `interpret=True`. The jit is the launcher's `jitted`
    attribute."""

    def wrap(fn):
        def keyed(*args, profiler_state, **kwargs):
            del profiler_state  # read by the kernels' compiler parameters while tracing: a key only
            return fn(*args, **kwargs)

        keyed.__name__ = keyed.__qualname__ = fn.__name__  # the jit's name in HLO and profiles
        jitted = jax.jit(keyed, static_argnames=static_argnames + ("profiler_state",))

        @functools.wraps(fn)
        def launch(*args, **kwargs):
            if kwargs.get("interpret"):
                out = fn(*args, **kwargs)
            else:
                out = jitted(*args, profiler_state=profiling.active(), **kwargs)
            return vma.kernel_outputs(out, args, kwargs)  # inside shard_map: see kernels/vma.py

        launch.jitted = jitted
        return launch

    return wrap
