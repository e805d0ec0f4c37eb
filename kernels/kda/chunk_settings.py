"""`chunk.py`'s traced module settings by name (`chunk.settings(...)`, re-exported there): each
key maps to the module attribute that the kernels read while tracing, so that a benchmark row or a
config can pick any of them, an unknown key or value raises, and `traced_key` makes a program
traced under one set of values a different jit cache entry from one traced under another."""

from __future__ import annotations

import contextlib
import importlib
import sys

from kernels.kda import chunk_intra, chunk_output, chunk_prep_bwd, chunk_segments, chunk_wy
from kernels.kda.chunk_intra import SCORES


def _chunk():
    """`kernels.kda.chunk` (it imports this module: looked up at call time)."""
    return importlib.import_module("kernels.kda.chunk")


def _settings_table(keys=None):
    """Setting key -> (module, attribute, allowed values): the module settings read while tracing
    (only those in `keys`, if given: "forward_only", impl="chunk_mosaic"'s route for calls that
    are not differentiated, imports the Mosaic GPU module only when asked for)."""
    ck = _chunk()
    table = {"diag": lambda: (chunk_intra, "DIAG_MODE", chunk_intra.DIAG_MODES),
             "rows": lambda: (chunk_intra, "ROW_MODE", chunk_intra.ROW_MODES),
             "cumsum": lambda: (chunk_intra, "CUMSUM_MODE", chunk_intra.CUMSUM_MODES),
             "scores_bwd": lambda: (chunk_intra, "SCORES_BWD", chunk_intra.SCORES_BWD_MODES),
             "inverse": lambda: (chunk_intra, "INVERSE_MODE", chunk_intra.INVERSE_MODES),
             "diag_stack": lambda: (chunk_intra, "DIAG_STACK", chunk_intra.STACKS),
             "offdiag_stack": lambda: (chunk_intra, "OFFDIAG_STACK", chunk_intra.STACKS),
             "scores": lambda: (ck, "DEFAULT_SCORES", SCORES),
             "forward_only": _forward_only_setting,
             "segments": lambda: (chunk_segments, "SEGMENTS", chunk_segments.SEGMENT_CHOICES),
             "forward_segments": lambda: (chunk_segments, "FORWARD_SEGMENTS", chunk_segments.SEGMENT_CHOICES),
             "block_v": lambda: (chunk_segments, "BLOCK_V", chunk_segments.BLOCK_V_CHOICES),
             "grad_issue": lambda: (chunk_segments, "GRAD_ISSUE", chunk_segments.GRAD_ISSUES),
             "grad_intra": lambda: (chunk_segments, "GRAD_INTRA", chunk_segments.GRAD_INTRAS),
             "scan_form": lambda: (chunk_segments, "SCAN_FORM", chunk_segments.SCAN_FORMS),
             "cotangents": lambda: (ck, "COTANGENTS", ck.COTANGENT_CHOICES),
             "residuals": lambda: (ck, "RESIDUALS", ck.RESIDUAL_CHOICES),
             "forward_state": lambda: (chunk_output, "FORWARD_STATE", chunk_output.FORWARD_STATE_CHOICES),
             "wy_bwd": lambda: (chunk_wy, "WY_BWD", chunk_wy.WY_BWD_CHOICES),
             "wy_form": lambda: (chunk_wy, "WY_FORM", chunk_wy.WY_FORMS),
             "wy_state": lambda: (chunk_wy, "WY_STATE", chunk_wy.WY_STATES),
             "state_buffers": _state_buffers_setting,
             "state_chain": _state_chain_setting,
             "prep_bwd": lambda: (chunk_prep_bwd, "PREP_BWD", chunk_prep_bwd.PREP_BWD_CHOICES),
             "train_intra": _train_intra_setting,
             "prep_bwd_cumsum": lambda: (chunk_prep_bwd, "PREP_BWD_CUMSUM", chunk_prep_bwd.PREP_BWD_CUMSUM_CHOICES)}
    for key in keys or ():
        if key not in table:
            raise ValueError(f"unknown KDA setting {key!r}; expected one of {SETTINGS}")
    return {k: entry() for k, entry in table.items() if keys is None or k in keys}


def traced_key() -> tuple:
    """The value of every setting in SETTINGS (those read while tracing): part of the jit cache key
    of this op and of any jitted caller that must not reuse a program traced under other settings."""
    ck = _chunk()
    ms = sys.modules.get("kernels.kda.chunk_mosaic")  # "forward_only" exists once the impl is imported
    mst = sys.modules.get("kernels.kda.mosaic_state")
    pg = sys.modules.get("kernels.kda.pallas_gpu")
    return chunk_intra.traced_settings() + (ck.DEFAULT_SCORES, chunk_segments.SEGMENTS,
                                            chunk_segments.forward_segments(), chunk_segments.BLOCK_V,
                                            chunk_segments.GRAD_ISSUE, chunk_segments.grad_intra(),
                                            chunk_segments.SCAN_FORM, ck.COTANGENTS, ck.RESIDUALS,
                                            chunk_output.FORWARD_STATE, ms.FORWARD_ONLY if ms else None,
                                            mst.buffers() if mst else None, mst.CHAIN if mst else None,
                                            *chunk_wy.wy_bwd_setting(),
                                            *chunk_prep_bwd.prep_bwd_setting(), pg.TRAIN_INTRA if pg else None)


def _state_buffers_setting():
    from kernels.kda import mosaic_state  # Mosaic GPU is only imported when a kernel setting is asked for

    return mosaic_state, "BUFFERS", mosaic_state.BUFFERS_CHOICES


def _state_chain_setting():
    from kernels.kda import mosaic_state  # Mosaic GPU is only imported when a kernel setting is asked for

    return mosaic_state, "CHAIN", mosaic_state.CHAIN_CHOICES


def _train_intra_setting():
    from kernels.kda import pallas_gpu  # Mosaic GPU is only imported when a kernel setting is asked for

    return pallas_gpu, "TRAIN_INTRA", pallas_gpu.TRAIN_INTRA_CHOICES


def _forward_only_setting():
    from kernels.kda import chunk_mosaic as ms  # imported when the setting is asked for

    return ms, "FORWARD_ONLY", ms.FORWARD_ONLY_CHOICES


SETTINGS = ("diag", "rows", "scores", "cumsum", "scores_bwd", "inverse", "diag_stack", "offdiag_stack",
            "forward_only", "segments", "block_v", "grad_issue", "grad_intra", "scan_form", "cotangents",
            "residuals", "forward_state", "wy_bwd", "wy_form", "wy_state", "state_buffers", "forward_segments",
            "prep_bwd", "train_intra", "prep_bwd_cumsum", "state_chain")


def setting_values(key: str) -> tuple:
    """The values module setting `key` (one of SETTINGS) accepts."""
    return _settings_table([key])[key][2]


@contextlib.contextmanager
def settings(**values):
    """Within the block, trace with these module settings (diag=, rows=, scores=, cumsum=,
    scores_bwd=, inverse=, diag_stack=, offdiag_stack=, forward_only=, segments=, block_v=,
    grad_issue=, grad_intra=, scan_form=, cotangents=, residuals=, forward_state=, wy_bwd=,
    wy_form=, wy_state=, state_buffers=, forward_segments=, prep_bwd=, train_intra=, prep_bwd_cumsum=,
    state_chain=; see SETTINGS),
    restored afterwards; an unknown key or value raises."""
    table = _settings_table(values)
    for key, value in values.items():
        if value not in table[key][2]:
            raise ValueError(f"KDA setting {key}={value!r}; expected one of {table[key][2]}")
    old = {k: getattr(table[k][0], table[k][1]) for k in values}
    try:
        for key, value in values.items():
            setattr(table[key][0], table[key][1], value)
        yield
    finally:
        for key, value in old.items():
            setattr(table[key][0], table[key][1], value)
