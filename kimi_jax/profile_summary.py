"""Where a jitted step's device time goes: sums the kernels of a `jax.profiler` trace by model part
(the `jax.named_scope`s the model and train step open: `mixer_kda`, `mixer_mla`, `ffn_mlp`,
`ffn_moe`, `attn_res`, `embed`, `head`, `loss`, `optimizer`), by kind of kernel (matmul,
collective, copy, custom call, other fusions) and by HLO op.

    python -m kimi_jax.profile_summary TRACE_DIR --hlo step.hlo.txt.gz --steps 2 [--out F.json]
    python benchmarks/train.py --rows 1:dots16:4 --profile_steps 2     # traces and summarises
    python train.py ... --config.profile_steps='(10, 12)'              # WORKDIR/profile/summary.json

Kernel events carry their HLO op's name (`hlo_op`); the optimized HLO text (`compiled.as_text()`)
maps that name to the op's `op_name` metadata, whose path holds the named scopes (a fusion without
metadata takes the most common scope of the ops it fuses). Times are summed kernel durations per
step: kernels on concurrent streams add up, so the total can exceed the step's wall time, and the
gap between the two is host-side or launch-bound time. With the HLO, each top op also gets what
its instruction says (`describe`: bytes of its operands and result, GB/s, source lines, op names).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import warnings

# Named scopes opened by kimi_jax (model.py, train_lib.py), outermost first.
# "kda_bwd": the chunked KDA backward (kernels/kda/chunk.py), a custom_vjp rule traced without
# its caller's scopes.
PARTS = ("optimizer", "loss", "head", "embed", "attn_res", "mixer_", "ffn_", "kda_bwd")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?.*\{\s*$")
_COMMENT = re.compile(r"/\*.*?\*/")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%?([\w.\-, %]+)\}?")
_OPNAME = re.compile(r'op_name="([^"]*)"')


def part_of(op_name: str) -> str:
    """The model part of an op's `op_name` path: the first known named scope, else "other"."""
    for token in re.findall(r"[A-Za-z_][\w]*", op_name or ""):
        for p in PARTS:
            if token == p or (p.endswith("_") and token.startswith(p)):
                return token
    return "other"


def scope_of(op_name: str, names) -> str:
    """The innermost of `names` (named scopes inside a part, e.g. a mixer's "proj", "conv", and a
    backward rule's "kda_bwd" inside "recurrence") on an op's `op_name` path, else "-"."""
    found = [t for t in re.findall(r"[A-Za-z_][\w]*", op_name or "") if t in names]
    return found[-1] if found else "-"


def kernel_kind(kernel: str, hlo_op: str) -> str:
    """matmul / collective / copy / custom call / fusion, from the kernel and HLO op names."""
    k, h = kernel.lower(), hlo_op.lower()
    if any(s in k for s in ("nccl", "all_reduce", "allreduce", "all_gather", "reduce_scatter")) or \
            any(s in h for s in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective")):
        return "collective"
    if any(s in k for s in ("gemm", "gemv", "xmma", "cutlass", "nvjet", "cublas", "wgmma")) or \
            h.startswith(("dot", "cublas", "gemm")):
        return "matmul"
    if "memcpy" in k or "memset" in k or h.startswith(("copy", "dynamic-update-slice")):
        return "copy"
    if h.startswith("custom-call") or "mosaic" in k or "cudnn" in k or "flash" in k:
        return "custom call"
    return "fusion/other"


def hlo_instructions(hlo_text: str):
    """(computation name or None, instruction name, text after "=") for every instruction line of
    an HLO module's text, in order."""
    comp = None
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m and not line.rstrip().endswith("{"):
            yield comp, m.group(1), m.group(2)
            continue
        c = _COMP.match(line)
        # A header's "=" can only come from comments such as a long result tuple's /*index=5*/.
        if c and "=" not in _COMMENT.sub("", line).split("{")[0]:
            comp = c.group(1)


def op_scopes(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> op_name metadata, for every instruction of the module; fusions
    and calls without metadata take the most common op_name of their called computations."""
    own, calls, comp_ops = {}, {}, collections.defaultdict(list)
    for comp, name, rest in hlo_instructions(hlo_text):
        meta = _OPNAME.search(rest)
        own[name] = meta.group(1) if meta else ""
        calls[name] = [c.strip(" %") for g in _CALLS.findall(rest) for c in g.split(",") if c.strip(" %")]
        if comp is not None:
            comp_ops[comp].append(name)

    def resolve(name, depth=0):
        if own.get(name) or depth > 8:
            return own.get(name, "")
        names = [resolve(op, depth + 1) for c in calls.get(name, ()) for op in comp_ops.get(c, ())]
        names = [n for n in names if n]
        return collections.Counter(names).most_common(1)[0][0] if names else ""
    return {name: resolve(name) for name in own}


def device_events(trace_dir: str) -> list[list[tuple[str, str, float]]]:
    """Device kernels of the newest trace under `trace_dir`, one list per stream in launch order,
    of (kernel name, hlo_op, duration ns) (GPU/TPU planes; on CPU, the XLA threads' ops)."""
    from jax.profiler import ProfileData

    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir!r}: was jax.profiler.start_trace given this folder?")
    data = ProfileData.from_file(files[-1])
    streams, host = [], []
    for plane in data.planes:
        device = plane.name.startswith("/device:")
        for line in plane.lines:
            if not device and not line.name.startswith("tf_XLA"):  # CPU: client and worker threads
                continue
            if device and line.name in ("XLA Modules", "XLA Ops", "Steps", "XLA TraceMe"):
                continue
            events = []
            for e in sorted(line.events, key=lambda e: e.start_ns):
                with warnings.catch_warnings():  # the stats' builtin type warns on iteration
                    warnings.simplefilter("ignore", DeprecationWarning)
                    stats = dict(e.stats)
                if "hlo_op" not in stats and not device:
                    continue
                events.append((e.name, str(stats.get("hlo_op", "")), float(e.duration_ns)))
            if events:
                (streams if device else host).append(events)
    return streams or host


def kernel_scopes(stream: list[tuple[str, str, float]], scopes: dict[str, str]) -> list[str]:
    """op_name of each kernel of one stream. A kernel maps to its `hlo_op`, or (inside a command
    buffer / CUDA graph, where `hlo_op` names the whole graph) to the fusion its name comes from
    ("loop_add_fusion_3" is "loop_add_fusion.3"). Library kernels (cuBLAS, cuDNN, Mosaic) inside
    a graph take the scope of the kernel launched before them on the stream (else after them):
    neighbours in launch order belong to the same layer part."""
    own = []
    for kernel, hlo_op, _ in stream:
        name = scopes.get(hlo_op) or scopes.get(kernel) or scopes.get(re.sub(r"_(\d+)$", r".\1", kernel))
        own.append(name or "")
    out, last = list(own), ""
    for i, name in enumerate(own):
        last = name or last
        out[i] = last
    nxt = ""
    for i in range(len(own) - 1, -1, -1):
        nxt = own[i] or nxt
        out[i] = out[i] or nxt
    return out


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "f32": 4, "s32": 4, "u32": 4,
                "f64": 8, "s64": 8}
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_FRAME = re.compile(r"stack_frame_id=(\d+)")


def array_bytes(text: str) -> int:
    """Bytes of every array type (`f32[4,64,128]`) written in `text`."""
    total = 0
    for dtype, dims in _ARRAY.findall(text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _DTYPE_BYTES.get(dtype, 4)
    return total


def stack_frames(hlo_text: str) -> dict[int, list[str]]:
    """stack_frame_id -> "file:line" of the frame and its callers, from the tables an HLO module's
    text ends with (FileNames, FileLocations, StackFrames), innermost first."""
    tables, section = {"FileNames": {}, "FileLocations": {}, "StackFrames": {}}, None
    for line in hlo_text.splitlines():
        if line.strip() in tables:
            section = line.strip()
        elif not line.strip() or line.startswith("%") or line.startswith("ENTRY"):
            section = None
        elif section:
            num, _, rest = line.strip().partition(" ")
            tables[section][int(num)] = rest
    files = {i: v.strip('"') for i, v in tables["FileNames"].items()}
    field = lambda text, key: int(re.search(key + r"=(\d+)", text).group(1))
    locs = {i: f"{os.path.basename(files.get(field(v, 'file_name_id'), '?'))}:{field(v, 'line')}"
            for i, v in tables["FileLocations"].items()}
    out = {}
    for i in tables["StackFrames"]:
        chain, j = [], i
        while j in tables["StackFrames"] and len(chain) < 12:
            v = tables["StackFrames"][j]
            loc = locs.get(field(v, "file_location_id"), "?")
            if not chain or chain[-1] != loc:  # nested jits repeat their call site
                chain.append(loc)
            j = field(v, "parent_frame_id") - 1  # the table's parent ids are one past the parent's; 0: none
        out[i] = chain
    return out


def instructions(hlo_text: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """(instruction name -> its line, computation name -> its lines) of an HLO module's text."""
    instrs, comps = {}, {}
    for comp, name, rest in hlo_instructions(hlo_text):
        instrs[name] = line = f"{name} = {rest.strip()}"
        comps.setdefault(comp, []).append(line)
    return instrs, comps


def _type_and_operands(line: str) -> tuple[str, list[str]]:
    """(result type text, operand names) of one HLO instruction line."""
    rhs = line.partition("=")[2].strip()
    m = re.match(r"(\(.*?\)|\S+)\s+[\w\-]+\((.*?)\)", rhs)
    if m is None:
        return rhs.split(" ")[0], []
    return m.group(1), [o.strip().lstrip("%") for o in m.group(2).split(",") if o.strip().startswith("%")]


def describe(op: str, instrs: dict, comps: dict, frames: dict, body_lines: int) -> dict | None:
    """Output/operand bytes, source lines, op names and fused body of HLO op `op` (None if not in
    the HLO)."""
    line = instrs.get(op) or instrs.get(re.sub(r"_(\d+)$", r".\1", op))
    if line is None:
        return None
    out_type, operands = _type_and_operands(line)
    called = re.search(r"calls=%?([\w.\-]+)", line)
    body = comps.get(called.group(1), []) if called else []
    texts = body + [line]  # producers first
    ids = list(dict.fromkeys(int(i) for t in texts for i in _FRAME.findall(t)))
    # Each distinct stack as its three innermost frames ("inner < caller < its caller").
    source = list(dict.fromkeys(" < ".join(frames.get(i, ["?"])[:3]) for i in ids))
    names = list(dict.fromkeys(n for t in texts for n in _OPNAME.findall(t)))
    # Operands are printed by name: their types are on their own instructions' lines.
    nbytes = array_bytes(out_type) + sum(array_bytes(_type_and_operands(instrs[o])[0]) for o in operands if o in instrs)
    return dict(instruction=line[:400], bytes=nbytes, source=source[:8], op_names=names[:8],
                body=[b[:240] for b in body[:body_lines]])


def annotate(summary: dict, hlo_text: str, body_lines: int = 0) -> dict:
    """Adds to each of `summary`'s top ops what its HLO instruction says (see `describe`) and its
    GB/s per launch; returns `summary`."""
    instrs, comps = instructions(hlo_text)
    frames = stack_frames(hlo_text)
    for o in summary["top_ops"]:
        # Kernels inside a CUDA graph are keyed "<kernel name> [<part>]"; their fusion is the HLO
        # instruction of that name ("loop_add_fusion_3" is "loop_add_fusion.3").
        d = describe(o["op"].split(" [")[0], instrs, comps, frames, body_lines)
        if d is not None:
            o.update(d)
            per_launch = o["ms"] / max(o["launches_per_step"], 1)
            o["gbps"] = d["bytes"] / (per_launch * 1e-3) / 1e9 if per_launch else None
    return summary


def summarize(trace_dir: str, hlo_text: str = "", steps: int = 1, top: int = 25, scopes_in_part=()) -> dict:
    """Per-step milliseconds by model part, by kernel kind and by kernel / HLO op (the `top`
    largest); with `scopes_in_part` (named scopes inside the parts), also by "part / scope"
    ("by_scope") and each top op's scope."""
    scopes = op_scopes(hlo_text) if hlo_text else {}
    by_part, by_kind, by_op = collections.Counter(), collections.Counter(), collections.Counter()
    part_kind = collections.Counter()
    by_scope, op_part, op_scope, count = collections.Counter(), {}, {}, collections.Counter()
    for stream in device_events(trace_dir):
        for (kernel, hlo_op, ns), op_name in zip(stream, kernel_scopes(stream, scopes)):
            ms = ns / 1e6 / steps
            part = part_of(op_name)
            kind = kernel_kind(kernel, hlo_op)
            by_part[part] += ms
            by_kind[kind] += ms
            part_kind[f"{part} / {kind}"] += ms
            key = f"{kernel[:80]} [{part}]" if hlo_op.startswith("command_buffer") or not hlo_op else hlo_op
            by_op[key] += ms
            count[key] += 1
            op_part[key] = part
            if scopes_in_part:
                op_scope[key] = scope_of(op_name, scopes_in_part)
                by_scope[f"{part} / {op_scope[key]}"] += ms
    total = sum(by_part.values())
    ops = [{"op": op, "part": op_part[op], "ms": ms, "launches_per_step": count[op] / steps}
           | ({"scope": op_scope[op]} if scopes_in_part else {}) for op, ms in by_op.most_common(top)]
    rnd = lambda c: {k: round(v, 3) for k, v in c.most_common()}  # noqa: E731
    out = {"steps": steps, "kernel_ms_per_step": round(total, 3), "by_part": rnd(by_part),
           "by_kind": rnd(by_kind), "by_part_and_kind": rnd(part_kind),
           "kernels_per_step": sum(count.values()) / steps, "top_ops": ops}
    if scopes_in_part:
        out["by_scope"] = rnd(by_scope)
    return out


def read_hlo(path: str) -> str:
    """HLO text from `path` (gzip if it ends in .gz)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return f.read()


def write_profile(folder: str, hlo_text: str, steps: int) -> dict:
    """Summarise the trace in `folder` (written by jax.profiler for `steps` steps of the program
    whose optimized HLO is `hlo_text`): writes `step.hlo.txt.gz` (to summarise again later) and
    `summary.json` there, returns the summary."""
    with gzip.open(os.path.join(folder, "step.hlo.txt.gz"), "wt") as f:
        f.write(hlo_text)
    summary = annotate(summarize(folder, hlo_text, steps, top=40), hlo_text)
    with open(os.path.join(folder, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def markdown(summary: dict) -> str:
    total = summary["kernel_ms_per_step"] or 1.0
    lines = [f"kernel time per step: {summary['kernel_ms_per_step']:.1f} ms in "
             f"{summary['kernels_per_step']:.0f} kernels", "", "| part | ms/step | share |", "|---|---|---|"]
    lines += [f"| {k} | {v:.2f} | {v / total:.1%} |" for k, v in summary["by_part"].items()]
    if "by_scope" in summary:
        lines += ["", "| part / scope | ms/step | share |", "|---|---|---|"]
        lines += [f"| {k} | {v:.2f} | {v / total:.1%} |" for k, v in summary["by_scope"].items()]
    lines += ["", "| kind | ms/step | share |", "|---|---|---|"]
    lines += [f"| {k} | {v:.2f} | {v / total:.1%} |" for k, v in summary["by_kind"].items()]
    lines += ["", "| kernel or HLO op | part | ms/step | launches/step | GB/s | source |", "|---|---|---|---|---|---|"]
    lines += [f"| {o['op']} | {o['part']} | {o['ms']:.2f} | {o['launches_per_step']:.0f} | "
              f"{'' if o.get('gbps') is None else round(o['gbps'])} | {', '.join(o.get('source', []))[:80]} |"
              for o in summary["top_ops"]]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace_dir")
    p.add_argument("--hlo", help="optimized HLO text of the traced program (compiled.as_text())")
    p.add_argument("--steps", type=int, default=1, help="steps in the trace (times are divided by it)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", help="JSON path")
    args = p.parse_args(argv)
    hlo = read_hlo(args.hlo) if args.hlo else ""
    summary = summarize(args.trace_dir, hlo, args.steps, args.top)
    if hlo:
        annotate(summary, hlo)
    print(markdown(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
