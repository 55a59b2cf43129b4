"""What an optimized GPU program does per call, from its HLO text (`jaxkv.gpu.aot` compiles
it): `analyze` counts GPU operations, host<->device transfers, host compute, loops and the
points where the host waits for the device; `overlap` and `summary` read its result.
Pure text processing: nothing here needs a GPU or the CUDA plugin."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Any

HOST_SPACE = "S(5)"  # XLA's layout memory-space annotation of pinned host memory

# ---- analysis ---------------------------------------------------------------------------------

# opcodes that launch nothing: aliases, views and control structure (their bodies are counted)
_NOT_OPS = frozenset(
    {
        "parameter",
        "constant",
        "bitcast",
        "tuple",
        "get-tuple-element",
        "after-all",
        "add-dependency",
        "opt-barrier",
        "partition-id",
        "replica-id",
        "domain",
        "while",
        "conditional",
        "call",
    }
)
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*->.*\{\s*$")
_INST = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_NAME = re.compile(r"%([^\s,(){}]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_HOST_COMPUTE = re.compile(r'_xla_compute_type="host"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_FUSION_KIND = re.compile(r"kind=(k\w+)")


def _balanced(s: str, start: int) -> int:
    """Index one past the parenthesis closing the one at s[start]."""
    depth = 0
    for i in range(start, len(s)):
        if s[i] == "(":
            depth += 1
        elif s[i] == ")":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced parentheses in HLO text: {s[start : start + 80]!r}")


def _split_tuple(t: str) -> list[str]:
    """Top-level elements of a tuple type string "(a, (b, c), d)"; [t] for an array type."""
    t = t.strip()
    if not t.startswith("("):
        return [t]
    inner, parts, depth, cur = t[1:-1], [], 0, []
    for ch in inner:
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if cur:
        parts.append("".join(cur).strip())
    return parts


def _leaves(t: str) -> list[str]:
    """Array types of a (possibly nested) tuple type."""
    parts = _split_tuple(t)
    if len(parts) == 1 and parts[0] == t.strip():
        return parts
    return [x for p in parts for x in _leaves(p)]


def _is_host(t: str) -> bool:
    return HOST_SPACE in t


def _is_scalar(t: str) -> bool:
    return "[]" in t.split("{")[0]


@dataclasses.dataclass
class _Inst:
    name: str
    type: str
    opcode: str
    operands: list[str]
    attrs: str


def parse_hlo(hlo_text: str) -> tuple[dict[str, list[_Inst]], str | None]:
    """Splits HLO text into {computation name: instructions} and returns the ENTRY's name."""
    comps: dict[str, list[_Inst]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.startswith("}"):  # "}" or e.g. '}, execution_thread="parallel"'
            current = None
            continue
        m = _INST.match(line)
        if not m:
            continue
        name, rest = m.group(1), m.group(2)
        if rest.startswith("("):
            end = _balanced(rest, 0)
            type_str, tail = rest[:end], rest[end:]
        else:
            sp = rest.find(" ")
            type_str, tail = (rest, "") if sp < 0 else (rest[:sp], rest[sp:])
        mo = _OPCODE.match(tail)
        if not mo:
            continue
        open_at = mo.end() - 1
        close = _balanced(tail, open_at)
        operands = _NAME.findall(tail[open_at:close])
        comps[current].append(_Inst(name, type_str, mo.group(1), operands, tail[close:]))
    return comps, entry


def _called(attrs: str, key: str) -> list[str]:
    m = re.search(key + r"=\{([^}]*)\}", attrs)
    if m:
        return _NAME.findall(m.group(1))
    m = re.search(key + r"=%?([^\s,{}]+)", attrs)
    return [m.group(1)] if m else []


_FIELDS = (
    "gpu_ops",
    "h2d",
    "d2h",
    "host_kernels",
    "host_compute",
    "loops",
    "unknown_trip_loops",
    "conditionals",
    "host_syncs",
    "command_buffers",
    "scope_gpu_ops",
    "scope_h2d",
    "scope_d2h",
)
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_BREAKDOWNS = ("ops_by_kind", "ops_by_source", "transfers", "loop_trips")


def _source(op_name: str) -> str:
    """An instruction's jax source path without the jit(...) frames and scan plumbing, e.g.
    "model/attention/host_part/reduce_max"."""
    parts = [p for p in op_name.split("/") if not p.startswith(("jit(", "pjit("))]
    return "/".join(p for p in parts if p not in ("while", "body", "eval_jaxpr", "closed_call"))


def analyze(hlo_text: str, scope: str | None = None) -> dict:
    """Counts what one call of an optimized (scheduled) XLA GPU HLO module executes.

    Computations reached from ENTRY through `while` (body, and condition when the trip count is
    unknown), `conditional` (branches) and `call` (to_apply) are walked; fusion, reduce, sort,
    async-wrapped and other called computations are the op that calls them and are not walked.

    Counting rules (each count multiplied by the known trip counts of the enclosing loops):
      gpu_ops: every instruction except parameter, constant, bitcast, tuple, get-tuple-element,
        after-all, add-dependency, opt-barrier, partition-id, replica-id, domain and the control
        ops while / conditional / call themselves (their bodies are counted). Each fusion,
        custom call, copy, copy-start, copy-done, async *-start and *-done, collective is one.
      while: with `"known_trip_count":{"n":N}` in its backend_config the body counts N times
        (XLA's WhileThunk then runs the body N times without evaluating the condition).
        Without it the condition and the body count once each and the loop adds 1 to
        `unknown_trip_loops` and to `host_syncs`: WhileThunk copies the predicate to the host
        and blocks on the stream every iteration (xla/backends/gpu/runtime/while_thunk.cc);
        the real number of syncs is that times the trip count, unknown here.
      conditional: each branch is counted on its own and the elementwise maximum over branches
        is taken (the worst branch per metric); the conditional adds 1 to `conditionals` and to
        `host_syncs`: ConditionalThunk copies the branch index to the host and calls
        BlockHostUntilDone (xla/backends/gpu/runtime/conditional_thunk.cc). Only a command
        buffer (CUDA graph) would avoid that, and XLA's default command buffer types include
        neither CONDITIONAL nor WHILE (xla/debug_options_flags.cc); jax 0.12 forms command
        buffers on thunks after the HLO (command_buffer_conversion_pass.cc), so the optimized
        HLO shows none. A conditional inside a `command_buffer*` computation (XLA's older
        HLO-level outlining, reached by a `call`) is not counted as a sync.
      h2d / d2h: transfers between host memory (layouts with S(5)) and the device, one per op:
        copy-start (result tuple element 0 is the destination), async *-start (element 1 is the
        output; e.g. an async dynamic-slice reading a host array on the H2D stream), and any
        other op (fusion, custom call, copy, dynamic-slice, ...) whose operands include a host
        buffer while it outputs a device buffer (h2d), or whose output is a host buffer while a
        non-scalar operand is a device buffer (d2h). *-done ops and host-compute ops are not
        transfers. `transfers` breaks them down by opcode.
      host_kernels: custom calls (Pallas Triton / Mosaic GPU kernels, FFI) that read a host
        operand or write a host output (also counted in h2d / d2h).
      host_compute: instructions with `_xla_compute_type="host"` (host compute offloading).
      command_buffers: `call`s to a `command_buffer*` computation.
      scope_gpu_ops / scope_h2d / scope_d2h: the same counts restricted to instructions whose
        metadata op_name contains the path segment `scope` (a `jax.named_scope`, e.g.
        "host_part" for the attention's host read); 0 when `scope` is None.
    Returns:
      dict with the fields above, `ops_by_kind` (a Counter of opcode, fusion kind or custom call
      target), `ops_by_source` (a Counter of (that kind, the jax source path of the op's
      metadata, `_source`): where the operations come from, e.g. to see which of them XLA
      emits differently at another size), `transfers` ({"h2d:<opcode>": n, "d2h:<opcode>": n})
      and `loop_trips` (a Counter of the known trip counts of the loops: {trip count: loops},
      e.g. {32: 1} for a scan over 32 layers).
    """
    comps, entry = parse_hlo(hlo_text)
    if entry is None:
        raise ValueError("no ENTRY computation found: expected the text of an HLO module")
    types = {i.name: i.type for insts in comps.values() for i in insts}

    def empty():
        return {f: 0 for f in _FIELDS} | {
            "ops_by_kind": Counter(),
            "ops_by_source": Counter(),
            "transfers": Counter(),
            "loop_trips": Counter(),
        }

    def add(dst, src, k=1):
        for f in _FIELDS:
            dst[f] += k * src[f]
        for key in _BREAKDOWNS:
            for name, n in src[key].items():
                dst[key][name] += k * n

    memo: dict[tuple[str, bool], dict] = {}

    def walk(comp: str, in_cmdbuf: bool, stack=()) -> dict:
        key = (comp, in_cmdbuf)
        if key in memo:
            return memo[key]
        if comp in stack:
            raise ValueError(f"recursive computation {comp!r} in HLO text")
        if comp not in comps:
            raise ValueError(f"computation {comp!r} is called but not defined in the HLO text")
        r = empty()
        for inst in comps[comp]:
            op = inst.opcode
            if op == "while":
                body = _called(inst.attrs, "body")[0]
                cond = _called(inst.attrs, "condition")[0]
                m = _TRIP.search(inst.attrs)
                sub = walk(body, in_cmdbuf, stack + (comp,))
                r["loops"] += 1
                if m:
                    add(r, sub, int(m.group(1)))
                    r["loop_trips"][int(m.group(1))] += 1
                else:
                    add(r, sub)
                    add(r, walk(cond, in_cmdbuf, stack + (comp,)))
                    r["unknown_trip_loops"] += 1
                    r["host_syncs"] += 1
                continue
            if op == "conditional":
                branches = _called(inst.attrs, "branch_computations") or (
                    _called(inst.attrs, "true_computation")
                    + _called(inst.attrs, "false_computation")
                )
                subs = [walk(b, in_cmdbuf, stack + (comp,)) for b in branches]
                worst = empty()
                for f in _FIELDS:
                    worst[f] = max(s[f] for s in subs)
                for key2 in _BREAKDOWNS:
                    for s in subs:
                        for name, n in s[key2].items():
                            worst[key2][name] = max(worst[key2][name], n)
                add(r, worst)
                r["conditionals"] += 1
                r["host_syncs"] += 0 if in_cmdbuf else 1
                continue
            if op == "call":
                for callee in _called(inst.attrs, "to_apply"):
                    cb = callee.startswith("command_buffer")
                    r["command_buffers"] += int(cb)
                    add(r, walk(callee, in_cmdbuf or cb, stack + (comp,)))
                continue
            if op in _NOT_OPS:
                continue
            r["gpu_ops"] += 1
            kind = op
            if op == "fusion":
                m = _FUSION_KIND.search(inst.attrs)
                kind = f"fusion:{m.group(1)}" if m else op
            elif op == "custom-call":
                m = _TARGET.search(inst.attrs)
                kind = f"custom-call:{m.group(1)}" if m else op
            r["ops_by_kind"][kind] += 1
            m = _OP_NAME.search(inst.attrs)
            r["ops_by_source"][(kind, _source(m.group(1)) if m else "?")] += 1
            scoped = bool(scope and m) and f"/{scope}/" in m.group(1) + "/"
            r["scope_gpu_ops"] += int(scoped)
            if _HOST_COMPUTE.search(inst.attrs):
                r["host_compute"] += 1
                continue
            if op.endswith("-done"):
                continue
            in_types = [types.get(o, "") for o in inst.operands]
            in_host = any(_is_host(t) for t in in_types)
            in_dev = any(t and not _is_host(t) and not _is_scalar(t) for t in in_types)
            if op == "copy-start":
                outs = [_split_tuple(inst.type)[0]]
            elif op.endswith("-start"):
                parts = _split_tuple(inst.type)
                outs = _leaves(parts[1]) if len(parts) > 1 else _leaves(inst.type)
            else:
                outs = _leaves(inst.type)
            out_host = any(_is_host(t) for t in outs)
            out_dev = any(not _is_host(t) for t in outs)
            h2d = in_host and out_dev
            d2h = out_host and in_dev
            r["h2d"] += int(h2d)
            r["d2h"] += int(d2h)
            r["scope_h2d"] += int(h2d and scoped)
            r["scope_d2h"] += int(d2h and scoped)
            if h2d:
                r["transfers"][f"h2d:{op}"] += 1
            if d2h:
                r["transfers"][f"d2h:{op}"] += 1
            if op == "custom-call" and (in_host or out_host):
                r["host_kernels"] += 1
        memo[key] = r
        return r

    out = walk(entry, False)
    return {
        **{f: out[f] for f in _FIELDS},
        "ops_by_kind": out["ops_by_kind"],
        "ops_by_source": out["ops_by_source"],
        "transfers": out["transfers"],
        "loop_trips": out["loop_trips"],
    }


def overlap(hlo_text: str) -> list[int]:
    """Per async computation on a side stream (a `call-start` with `_xla_stream_annotation`,
    e.g. `jaxkv.cache.transfer`'s host reads), the GPU operations the schedule runs on the compute
    stream between its start and its done: what the transfer overlaps. ENTRY's first, then
    those of the other computations (e.g. a while body), each in schedule order.

    The optimized module is scheduled: instruction order within a computation is the order
    the ops are launched, so ops between a start and its done run while it is in flight."""
    comps, entry = parse_hlo(hlo_text)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    out = []
    # ENTRY first, then the other computations (a while body: the decode step's layer scan)
    for name in [entry] + [c for c in comps if c != entry]:
        insts = comps[name]
        where = {i.name: n for n, i in enumerate(insts)}
        for n, inst in enumerate(insts):
            if inst.opcode != "call-done" or "_xla_stream_annotation" not in inst.attrs:
                continue
            start = where.get(inst.operands[0]) if inst.operands else None
            if start is None:
                continue
            between = insts[start + 1 : n]
            out.append(
                sum(
                    1
                    for i in between
                    if i.opcode not in _NOT_OPS and not i.opcode.endswith(("-start", "-done"))
                )
            )
    return out


_MLIR_OP = re.compile(r'^\s*(?:%[^=]*=\s*)?"?([a-z_]+\.[a-z_][\w.]*)"?[\s(<{]')
_MLIR_FUNC = re.compile(r"^(\s*)func\.func\s+(?:public\s+|private\s+)?@([\w.$-]+)\(")
_MLIR_CALL = re.compile(r"(?<![\w.])(?:func\.)?call @([\w.$-]+)\(")


def program_ops(stablehlo_text: str) -> list[str]:
    """The operations of a lowered (StableHLO / MLIR) program by name (e.g.
    "stablehlo.dot_general"), in text order from its public function, each call of a private
    function replaced by that function's operations (jax shares one private function between
    calls of equal shapes, so the functions alone depend on shapes) and each region's ops
    listed once: the program jaxkv emits, before XLA picks kernels for it. Two programs with
    the same list differ only in shapes and constants, so a decode step whose list is the same
    at every context has no per-block structure, whatever XLA's size-dependent kernel choices
    make of it (`analyze`'s gpu_ops)."""
    funcs: dict[str, list[str]] = {}
    public = None
    name, indent, body = None, "", []
    for line in stablehlo_text.splitlines():
        m = _MLIR_FUNC.match(line)
        if m:
            indent, name, body = m.group(1), m.group(2), []
            public = public or (name if " public " in line or "private" not in line else None)
            continue
        if name is None:
            continue
        if line.rstrip() == indent + "}":
            funcs[name], name = body, None
            continue
        body.append(line)
    if public is None:
        raise ValueError("no public func.func in the text: expected a lowered StableHLO module")
    memo: dict[str, list[str]] = {}

    def expand(fn: str, stack=()) -> list[str]:
        if fn in memo:
            return memo[fn]
        if fn in stack or fn not in funcs:
            raise ValueError(f"function @{fn} is recursive or not defined in the text")
        out = []
        for line in funcs[fn]:
            call = _MLIR_CALL.search(line)
            if call and call.group(1) in funcs:
                out += expand(call.group(1), stack + (fn,))
            elif m := _MLIR_OP.match(line):
                out.append(m.group(1))
        memo[fn] = out
        return out

    return expand(public)


def program_digest(ops: list[str]) -> str:
    """A short digest of a `program_ops` list (equal lists, equal digests)."""
    import hashlib

    return hashlib.sha1("\n".join(ops).encode()).hexdigest()[:12]


def summary(analysis: dict) -> dict[str, Any]:
    """The scalar fields of an `analyze` result (drops the per-kind breakdowns)."""
    return {f: analysis[f] for f in _FIELDS}
