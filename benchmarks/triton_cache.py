"""The Triton cache that keeps flash-linear-attention's compiled kernels and autotuning results
between benchmark runs (`benchmarks/kda.py --triton_cache DIR --autotune_archive F.tgz`): the GPU
machines start bare, so a committed archive of `<hash>/<kernel>.autotune.json` files seeds the
cache and fla runs the configurations its autotuner chose before instead of tuning for minutes."""

from __future__ import annotations

import os
import sys


def count_autotune_results(folder: str) -> int:
    """Triton's on-disk autotuning results (`<kernel>.autotune.json`) under `folder`."""
    return sum(name.endswith(".autotune.json") for _, _, names in os.walk(folder) for name in names)


def use_triton_cache(folder: str) -> dict:
    """Point Triton's cache (compiled kernels and, with fla's `cache_results`, autotuning results) at
    `folder`; must run before torch or triton are imported, else Triton has read its default."""
    if "triton" in sys.modules:
        raise RuntimeError("--triton_cache must be set before triton is imported")
    folder = os.path.abspath(folder)
    os.makedirs(folder, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = folder
    os.environ.setdefault("FLA_CACHE_RESULTS", "1")
    found = count_autotune_results(folder)
    print(f"# Triton cache {folder}: {found} autotuning results", flush=True)
    # no host paths in results: the folder relative to the repo, or only its name
    shown = os.path.relpath(folder) if folder.startswith(os.getcwd() + os.sep) else os.path.basename(folder)
    return dict(dir=shown, autotune_results_before=found, autotune_results_after=found)


AUTOTUNE_SUFFIX = ".autotune.json"


def load_autotune_archive(archive: str, folder: str) -> int:
    """Extract the autotuning results of `archive` (a .tgz of `<hash>/<kernel>.autotune.json`) into
    the Triton cache `folder`; returns how many. A missing archive is not an error (a first run)."""
    import tarfile

    if not os.path.exists(archive):
        return 0
    with tarfile.open(archive, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.endswith(AUTOTUNE_SUFFIX)]
        for m in members:
            parts = os.path.normpath(m.name).split(os.sep)
            if m.name.startswith("/") or ".." in parts:
                raise ValueError(f"{archive}: unsafe member path {m.name!r}")
        tar.extractall(folder, members=members, filter="data")
    return len(members)


def save_autotune_archive(folder: str, archive: str) -> int:
    """Write every autotuning result under the Triton cache `folder` into `archive` (.tgz, paths
    relative to the folder); returns how many."""
    import tarfile

    found = sorted(os.path.relpath(os.path.join(root, n), folder) for root, _, names in os.walk(folder)
                   for n in names if n.endswith(AUTOTUNE_SUFFIX))
    os.makedirs(os.path.dirname(os.path.abspath(archive)), exist_ok=True)
    tmp = archive + ".tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for rel in found:
            tar.add(os.path.join(folder, rel), arcname=rel)
    os.replace(tmp, archive)  # a run killed while writing keeps the previous archive
    return len(found)
