"""Where a training step's device time goes (bench-only): reads a ``jax.profiler`` trace directory and the
compiled HLO text of the step, and splits the step's device time into categories (ms per step, % of step).

  python bench/step_profile.py DIR --hlo DIR/step.hlo.txt --steps 3 [--step-ms 123.4]

``bench/bench_model.py --profile DIR`` writes DIR/<config>/<variant>/ (the trace under plugins/profile/<run>/
and ``step.hlo.txt``) and calls :func:`report` itself.

What it relies on (check these on a new jax / GPU):

- The trace: the newest ``*.trace.json.gz`` under DIR (chrome trace format; ``jax.profiler.trace`` writes
  one next to its ``*.xplane.pb``), else ``*.xplane.pb`` through ``jax.profiler.ProfileData``. Device
  events: processes (planes) named ``/device:...`` (GPU: ``/device:GPU:0``); within them the threads
  (lines) named ``Stream ...`` (the CUPTI kernel and memcpy activities), else a line named ``XLA Ops``,
  else every line but ``XLA Modules`` / ``Steps`` / ``Launch Stats``. Without device processes (CPU) the
  host events that carry an ``hlo_op`` arg (XLA:CPU's thunk executor) are the ops.
- Event -> HLO instruction: ``args["hlo_op"]`` (XLA's GPU annotation ``name:#hlo_op=...,hlo_module=...#``
  decoded into stats/args), else the ``%name`` at the start of ``args["long_name"]``, else the event name
  itself, else the event name up to its first ``:`` -- when that name is an instruction of the HLO text.
  Everything else counts as unmapped (reported; its time goes to a category by its kernel name,
  KERNEL_RULES, else to ``rest``). Events whose
  ``hlo_module`` arg names another module (``jit_dynamic_slice``, ...) are left out and reported apart.
  While profiling, XLA runs command buffers (CUDA graphs) thunk by thunk (unless
  ``--xla_enable_command_buffers_during_profiling``), so kernels keep their own ``hlo_op``; time mapped
  to a ``call`` instruction (a whole command buffer) goes to ``rest`` and is reported.
- Time per step: the sum of the durations of the device events (busy time; concurrent streams or CPU
  threads add up) divided by the number of traced steps (``steps``, else the number of distinct
  ``run_id`` args, else 1). ``% step``: of ``step_ms`` (the timed step) when given, else of the busy time.

Categories (the first rule that matches an instruction wins; a fusion is judged by its fused
computations too):

1. ``fp8 GEMM fprop / dgrad / wgrad``: custom calls ``jf_cublaslt_gemm`` and ``jf_cutlass_gemm``. Backward when
   the call's ``metadata={op_name=...}`` holds ``transpose(`` (JAX's name stack of a VJP; the forward
   reads ``jvp(...)``), else fprop. In the backward: wgrad when both operands have 1x128 blocks (the
   call's FFI attributes ``a_block_rows = 1`` and ``b_block_rows = 1``: jax_fp8's plan runs wgrad as
   1x128 x 1x128, fprop and dgrad as 1x128 x 128x128), dgrad otherwise; without those attributes, wgrad
   when both data operands are 3-D (stacked over sequences: the contraction mode), else dgrad.
2. ``our fused producers``: custom calls ``jf_produce_quantize`` (a norm or activation fused with its
   quantization); ``our quantize``: the other ``jf_*`` calls but the GEMM (``jf_quantize``, ...).
3. ``attention``: a custom call whose target holds ``fmha`` (cuDNN flash attention) or an instruction
   whose op_name (or a fused one's) holds ``dot_product_attention``, or the einsum names of JAX's XLA
   attention (``BTNH``/``BNTS``).
4. ``XLA FP8 GEMMs``: GEMMs (``__cublas*`` custom calls, ``dot``/``convolution``, GEMM fusions: a fusion
   whose backend config names ``__triton_gemm``/``__cublas``/``__cudnn``, or that contains a dot) with a
   float8 (``f8e...``) operand, or the ``__cublas$lt$matmul$f8`` target.
5. ``bf16 GEMMs``: the other GEMMs of rule 4 (on CPU these include the FP8 GEMM's reference math).
6. ``FP8 quantize fusions (flax)``: an instruction producing a float8 value or whose op_name (or a fused
   one's) names flax's FP8 ops (``Fp8...Op``, ``fp8_ops``).
7. ``XLA around our calls``: a data-movement kernel (opcode copy / transpose / pad / slice / concatenate /
   dynamic-slice / dynamic-update-slice / convert / bitcast-convert / reshape / broadcast / reverse /
   copy-start / copy-done, or a fusion made only of those, parameters, constants, bitcasts, tuples and
   get-tuple-elements) that consumes a ``jf_*`` call's result or produces one of its operands, looking
   through get-tuple-element / bitcast / tuple and across ``call`` boundaries (command buffers), and
   along chains of such movement kernels (up to 4 deep).
8. ``other data movement``: the other data-movement kernels of rule 7.
9. ``rest``: everything else, unmapped events included.

It never raises from :func:`report` (errors are printed): a profile must not break the benchmark.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import traceback
from typing import Optional

FP8_FPROP, FP8_DGRAD, FP8_WGRAD = "fp8 GEMM fprop", "fp8 GEMM dgrad", "fp8 GEMM wgrad"
OURS_Q, XLA_FP8, BF16, FLAX_Q = "our quantize", "XLA FP8 GEMMs", "bf16 GEMMs", "FP8 quantize fusions (flax)"
OURS_P = "our fused producers"
ATTN, AROUND, MOVE, REST = "attention", "XLA around our calls", "other data movement", "rest"
CATEGORIES = (FP8_FPROP, FP8_DGRAD, "fp8 GEMM fprop+dgrad (by kernel name)", FP8_WGRAD, OURS_Q, OURS_P, XLA_FP8, FLAX_Q, BF16,
              ATTN, AROUND, MOVE, REST)

FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "add-dependency",
        "opt-barrier", "domain"}
MOVEMENT = {"copy", "transpose", "pad", "slice", "concatenate", "dynamic-slice", "dynamic-update-slice", "convert",
            "bitcast-convert", "reshape", "broadcast", "reverse", "copy-start", "copy-done"}
CALLERS = {"call", "async-start"}  # instructions whose called computation's parameters are their operands
GEMM_OPS = {"dot", "convolution"}
ATTN_RE = re.compile(r"dot_product_attention|BTNH|BNTS|fmha|flash_attention")
FLAX_RE = re.compile(r"Fp8\w*Op|fp8_ops")
F8_RE = re.compile(r"\bf8e\d")
CHAIN_DEPTH = 4
#: Kernel names, for device events the trace does not tie to an HLO instruction (the H200 trace of
#: 2026-12-05 named most GPU events by kernel only): cuBLASLt's block-scaled FP8 kernels carry the scale
#: mode of their A operand (our b): Ablk128 (128x128 tiles: fprop or dgrad), Avec128 (1x128: wgrad);
#: "qq"/"qr"/"rq" nvjet kernels without one are per-tensor FP8 (flax's), "tst" alone bf16.
KERNEL_RULES = (
    (re.compile(r"nvjet\w*_Ablk128|cutlass\w*Blockwise|GemmUniversal"), "fp8 GEMM fprop+dgrad (by kernel name)"),
    (re.compile(r"nvjet\w*_Avec128"), FP8_WGRAD),
    (re.compile(r"jf::.*(Packed<|swiglu_pair_kernel|norm_stats_kernel|produce_values_kernel)"), OURS_P),  # producer kernels
    (re.compile(r"jf::"), OURS_Q),
    (re.compile(r"sdpa|fmha|flash"), ATTN),
    (re.compile(r"nvjet_sm\d+_(qq|qr|rq)"), XLA_FP8),
    (re.compile(r"nvjet|gemm|Gemm|cutlass"), BF16),
)


# ---- HLO text --------------------------------------------------------------------------------------
class Instr:
    __slots__ = ("name", "opcode", "type", "operands", "attrs", "comp", "target", "calls", "op_name", "param",
                 "root")

    def __init__(self, name, opcode, type_, operands, attrs, comp, param, root):
        self.name, self.opcode, self.type, self.operands, self.attrs = name, opcode, type_, operands, attrs
        self.comp, self.param, self.root = comp, param, root
        m = re.search(r'custom_call_target="([^"]*)"', attrs)
        self.target = m.group(1) if m else ""
        self.calls = []
        for m in re.finditer(r"\b(?:calls|to_apply|body|condition|branch_computations)=(\{[^}]*\}|%?[\w.\-]+)", attrs):
            self.calls += [c for c in re.findall(r"%?([\w.\-]+)", m.group(1))]
        m = re.search(r'op_name="([^"]*)"', attrs)
        self.op_name = m.group(1) if m else ""


_INSTR = re.compile(r"^\s+(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s")


def _balanced(s: str, i: int) -> int:
    """Index just past the bracket group opening at s[i] ('(' or '{')."""
    open_, close = s[i], {"(": ")", "{": "}", "[": "]"}[s[i]]
    depth = 0
    for j in range(i, len(s)):
        if s[j] == open_:
            depth += 1
        elif s[j] == close:
            depth -= 1
            if depth == 0:
                return j + 1
    return len(s)


class Hlo:
    """The instructions of a compiled HLO module's text (every computation; names are module-unique)."""

    def __init__(self, text: str):
        self.module = ""
        self.instrs: dict[str, Instr] = {}
        self.comps: dict[str, list[str]] = collections.defaultdict(list)
        self.roots: dict[str, str] = {}
        m = re.search(r"^HloModule\s+([\w.\-]+)", text, re.M)
        self.module = m.group(1) if m else ""
        comp = ""
        for line in text.splitlines():
            if not line.strip() or line.lstrip().startswith("//"):
                continue
            if not line[0].isspace():
                m = _COMP.match(line)
                if m and line.rstrip().endswith("{"):
                    comp = m.group(1)
                continue
            m = _INSTR.match(line)
            if not m:
                continue
            ins = self._parse(m.group(2), m.group(3), comp, bool(m.group(1)))
            if ins is not None:
                self.instrs[ins.name] = ins
                self.comps[comp].append(ins.name)
                if ins.root:
                    self.roots[comp] = ins.name
        self.users: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
        for ins in self.instrs.values():
            for k, o in enumerate(ins.operands):
                self.users[o].append((ins.name, k))
        self.callers: dict[str, list[str]] = collections.defaultdict(list)  # computation -> call instructions
        for ins in self.instrs.values():
            if ins.opcode in CALLERS:
                for c in ins.calls:
                    self.callers[c].append(ins.name)
        self._pure: dict[str, bool] = {}
        self._fused: dict[str, list] = {}

    @staticmethod
    def _parse(name, rest, comp, root) -> Optional[Instr]:
        rest = rest.strip()
        if rest.startswith("("):
            end = _balanced(rest, 0)
        else:
            m = re.match(r"\S+", rest)
            end = m.end() if m else 0
        type_, tail = rest[:end], rest[end:].lstrip()
        m = re.match(r"([\w\-$]+)\(", tail)
        if not m:
            return None
        opcode = m.group(1)
        close = _balanced(tail, m.end() - 1)
        inner, attrs = tail[m.end():close - 1], tail[close:]
        operands = re.findall(r"%([\w.\-]+)", inner)
        if not operands and opcode != "parameter" and opcode != "constant":  # operands printed without '%'
            operands = [t.split()[-1] for t in re.split(r",\s*(?![^\[{(]*[\]})])", inner) if t.strip()
                        and re.match(r"^[\w.\-]+$", t.split()[-1]) and not t.strip()[0].isdigit()]
        param = None
        if opcode == "parameter":
            pm = re.match(r"\s*(\d+)", inner)
            param = int(pm.group(1)) if pm else None
            operands = []
        return Instr(name, opcode, type_, operands, attrs, comp, param, root)

    # -- properties of instructions --
    def fused(self, ins: Instr) -> list:
        """The instructions of the computations ``ins`` calls, recursively (a fusion's body)."""
        if ins.name not in self._fused:
            out, seen, todo = [], set(), list(ins.calls)
            while todo:
                c = todo.pop()
                if c in seen:
                    continue
                seen.add(c)
                for n in self.comps.get(c, ()):
                    sub = self.instrs[n]
                    out.append(sub)
                    todo += sub.calls
            self._fused[ins.name] = out
        return self._fused[ins.name]

    def is_movement(self, ins: Instr) -> bool:
        if ins.opcode in MOVEMENT:
            return True
        if ins.opcode != "fusion":
            return False
        if ins.name not in self._pure:
            body = self.fused(ins)
            self._pure[ins.name] = bool(body) and all(s.opcode in MOVEMENT or s.opcode in FREE for s in body)
        return self._pure[ins.name]

    def operand_types(self, ins: Instr) -> list[str]:
        types = [self.instrs[o].type for o in ins.operands if o in self.instrs]
        if ins.opcode == "fusion":
            types += [s.type for s in self.fused(ins) if s.opcode == "parameter"]
        return types

    # -- dataflow through free ops and call boundaries --
    def producers(self, name: str, index: Optional[int] = None, depth: int = 0) -> set:
        """The kernel instructions that produce the value ``name`` (element ``index`` of a tuple),
        looking through get-tuple-element, bitcast, tuple, parameters of called computations."""
        ins = self.instrs.get(name)
        if ins is None or depth > 32:
            return set()
        if ins.opcode == "get-tuple-element":
            m = re.search(r"index=(\d+)", ins.attrs)
            return self.producers(ins.operands[0], int(m.group(1)) if m else None, depth + 1) if ins.operands else set()
        if ins.opcode == "bitcast" and ins.operands:
            return self.producers(ins.operands[0], index, depth + 1)
        if ins.opcode == "tuple":
            ops = ins.operands if index is None or index >= len(ins.operands) else [ins.operands[index]]
            return set().union(*(self.producers(o, None, depth + 1) for o in ops)) if ops else set()
        if ins.opcode == "parameter":
            out = set()
            for caller in self.callers.get(ins.comp, ()):
                ops = self.instrs[caller].operands
                if ins.param is not None and ins.param < len(ops):
                    out |= self.producers(ops[ins.param], index, depth + 1)
            return out
        if ins.opcode in CALLERS and ins.calls and ins.calls[0] in self.roots:
            return self.producers(self.roots[ins.calls[0]], index, depth + 1)
        if ins.opcode in FREE:
            return set()
        return {name}

    def consumers(self, name: str, index: Optional[int] = None, depth: int = 0) -> set:
        """The kernel instructions that consume the value ``name`` (its element ``index``), looking
        through get-tuple-element, bitcast, tuple and call boundaries."""
        out = set()
        if depth > 32:
            return out
        ins = self.instrs.get(name)
        if ins is not None and ins.root and ins.comp in self.callers:  # a called computation's result
            for caller in self.callers[ins.comp]:
                out |= self.consumers(caller, index, depth + 1)
        for user, k in self.users.get(name, ()):
            u = self.instrs[user]
            if u.opcode == "get-tuple-element":
                m = re.search(r"index=(\d+)", u.attrs)
                if index is None or m is None or int(m.group(1)) == index:
                    out |= self.consumers(user, None, depth + 1)
            elif u.opcode == "bitcast":
                out |= self.consumers(user, index, depth + 1)
            elif u.opcode == "tuple":
                out |= self.consumers(user, k, depth + 1) if index is None else set()
            elif u.opcode in CALLERS and u.calls:
                for p in self.comps.get(u.calls[0], ()):
                    pi = self.instrs[p]
                    if pi.opcode == "parameter" and pi.param == k:
                        out |= self.consumers(p, index, depth + 1)
            elif u.opcode not in FREE:
                out.add(user)
        return out


def ours(ins: Instr) -> bool:
    return ins.opcode == "custom-call" and ins.target.startswith("jf_")


def around_our_calls(hlo: Hlo) -> set:
    """Data-movement kernels next to a ``jf_*`` custom call (rule 7 of the module doc)."""
    marked = set()
    for ins in list(hlo.instrs.values()):
        if not ours(ins):
            continue
        for o in ins.operands:
            frontier = hlo.producers(o)
            for _ in range(CHAIN_DEPTH):
                nxt = set()
                for p in frontier:
                    pi = hlo.instrs[p]
                    if p not in marked and hlo.is_movement(pi):
                        marked.add(p)
                        for oo in pi.operands:
                            nxt |= hlo.producers(oo)
                frontier = nxt
        frontier = hlo.consumers(ins.name)
        for _ in range(CHAIN_DEPTH):
            nxt = set()
            for c in frontier:
                if c not in marked and hlo.is_movement(hlo.instrs[c]):
                    marked.add(c)
                    nxt |= hlo.consumers(c)
            frontier = nxt
    return marked


def _op_names(hlo: Hlo, ins: Instr) -> list[str]:
    names = [ins.op_name]
    if ins.opcode == "fusion":
        names += [s.op_name for s in hlo.fused(ins)]
    return [n for n in names if n]


def _is_gemm(hlo: Hlo, ins: Instr) -> bool:
    if ins.opcode in GEMM_OPS:
        return True
    if ins.opcode == "custom-call":
        t = ins.target.lower()
        return "cublas" in t or "gemm" in t or "matmul" in t
    if ins.opcode == "fusion":
        if re.search(r"__triton_gemm|__cublas|__cudnn\$fusion|triton_gemm", ins.attrs):
            return True
        return any(s.opcode in GEMM_OPS or (s.opcode == "custom-call" and "cublas" in s.target) for s in hlo.fused(ins))
    return False


def fp8_gemm_kind(hlo: Hlo, ins: Instr) -> str:
    if "transpose(" not in ins.op_name:
        return FP8_FPROP
    a = re.search(r"a_block_rows\s*=\s*(\d+)", ins.attrs)
    b = re.search(r"b_block_rows\s*=\s*(\d+)", ins.attrs)
    if a and b:
        return FP8_WGRAD if int(a.group(1)) == 1 and int(b.group(1)) == 1 else FP8_DGRAD
    ranks = [hlo.instrs[o].type.count(",") + 1 for o in ins.operands[:3:2] if o in hlo.instrs]
    return FP8_WGRAD if len(ranks) == 2 and all(r == 3 for r in ranks) else FP8_DGRAD


def classify(hlo: Hlo) -> dict[str, str]:
    """instruction name -> category, for every instruction of the module."""
    around = around_our_calls(hlo)
    out = {}
    for name, ins in hlo.instrs.items():
        names = _op_names(hlo, ins)
        if ours(ins):
            out[name] = (fp8_gemm_kind(hlo, ins) if ins.target in ("jf_cublaslt_gemm", "jf_cutlass_gemm")
                         else OURS_P if ins.target == "jf_produce_quantize" else OURS_Q)
        elif "fmha" in ins.target.lower() or any(ATTN_RE.search(n) for n in names):
            out[name] = ATTN
        elif _is_gemm(hlo, ins):
            f8 = "$f8" in ins.target or any(F8_RE.search(t) for t in hlo.operand_types(ins))
            out[name] = XLA_FP8 if f8 else BF16
        elif F8_RE.search(ins.type) or any(FLAX_RE.search(n) for n in names):
            out[name] = FLAX_Q
        elif name in around:
            out[name] = AROUND
        elif hlo.is_movement(ins):
            out[name] = MOVE
        else:
            out[name] = REST
    return out


# ---- the trace -------------------------------------------------------------------------------------
def find_trace(path: str) -> tuple[Optional[str], Optional[str]]:
    """(newest ``*.trace.json.gz``, newest ``*.xplane.pb``) under ``path`` (a file: itself)."""
    if os.path.isfile(path):
        return (path, None) if path.endswith((".json.gz", ".json")) else (None, path)
    newest = lambda pat: max(glob.glob(os.path.join(path, "**", pat), recursive=True), key=os.path.getmtime,  # noqa
                             default=None)
    return newest("*.trace.json.gz") or newest("perfetto_trace.json.gz"), newest("*.xplane.pb")


SKIP_LINES = ("XLA Modules", "Steps", "Launch Stats", "Source", "Framework", "TensorFlow")


def _self_times(events: list) -> list:
    """Events of one thread with each duration less that of the events nested in it (a CPU while
    loop's event holds its body's ops; GPU kernels of one stream do not nest)."""
    order = sorted(range(len(events)), key=lambda i: (events[i][2], -events[i][1]))
    self_t = [e[1] for e in events]
    stack = []  # indices of open events
    for i in order:
        ts, dur = events[i][2], events[i][1]
        while stack and events[stack[-1]][2] + events[stack[-1]][1] <= ts + 1e-9:
            stack.pop()
        if stack and ts + dur <= events[stack[-1]][2] + events[stack[-1]][1] + 1e-9:
            self_t[stack[-1]] -= dur
        stack.append(i)
    return [(e[0], max(t, 0.0), e[2], e[3]) for e, t in zip(events, self_t)]


def _pick_device_events(groups: dict) -> list:
    """groups: (process, thread) -> events [(name, dur_us, ts_us, args)]: (the device events (module doc),
    with self times (:func:`_self_times`), where they came from)."""
    groups = {k: _self_times([e for e in v if not e[0].startswith("end:")]) for k, v in groups.items()}
    dev = {k: v for k, v in groups.items() if "/device:" in k[0]}
    if dev:
        streams = {k: v for k, v in dev.items() if k[1].startswith("Stream")}
        if not streams:
            streams = {k: v for k, v in dev.items() if k[1] == "XLA Ops"}
        if not streams:
            streams = {k: v for k, v in dev.items() if not k[1].startswith(SKIP_LINES)}
        lines = sorted({k[1] for k in streams})
        return [e for v in streams.values() for e in v], f"device lines {', '.join(lines[:4])}" + (
            f" (+{len(lines) - 4})" if len(lines) > 4 else "")
    return [e for v in groups.values() for e in v if "hlo_op" in e[3]], (
        "host threads' hlo_op events (no /device: plane: a CPU run, or no CUPTI on a GPU: then these are launch "
        "times, not kernel times)")


def read_json_trace(path: str) -> list:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M":
            if e.get("name") == "process_name":
                procs[e.get("pid")] = str((e.get("args") or {}).get("name", ""))
            elif e.get("name") == "thread_name":
                threads[(e.get("pid"), e.get("tid"))] = str((e.get("args") or {}).get("name", ""))
    groups = collections.defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        key = (procs.get(e.get("pid"), ""), threads.get((e.get("pid"), e.get("tid")), ""))
        groups[key].append((str(e.get("name", "")), float(e.get("dur", 0.0)), float(e.get("ts", 0.0)),
                            e.get("args") or {}))
    return _pick_device_events(groups)


def read_xplane(path: str) -> list:
    from jax.profiler import ProfileData

    pd = ProfileData.from_file(path)
    groups = collections.defaultdict(list)
    for plane in pd.planes:
        for line in plane.lines:
            for ev in line.events:
                args = {k: v for k, v in ev.stats}
                groups[(plane.name, line.name)].append((ev.name, ev.duration_ns / 1e3, ev.start_ns / 1e3, args))
    return _pick_device_events(groups)


def _instr_of(hlo: Hlo, name: str, args: dict) -> Optional[str]:
    cands = [args.get("hlo_op")]
    ln = args.get("long_name")
    if isinstance(ln, str):
        m = re.match(r"\s*%?([\w.\-]+)\s*=", ln)
        cands.append(m.group(1) if m else None)
    cands += [name, name.split(":")[0].strip(), name.split(" ")[0]]
    for c in cands:
        if isinstance(c, str) and c.lstrip("%") in hlo.instrs:
            return c.lstrip("%")
    return None


# ---- the table -------------------------------------------------------------------------------------
def analyze(trace_dir: str, hlo_text: str, steps: Optional[int] = None, step_ms: Optional[float] = None) -> dict:
    """The split of the traced steps' device time (the dict :func:`format_table` prints)."""
    hlo = Hlo(hlo_text)
    cats = classify(hlo)
    jpath, xpath = find_trace(trace_dir)
    events, source, where = [], None, ""
    if jpath:
        (events, where), source = read_json_trace(jpath), jpath
    if not any("hlo_op" in e[3] for e in events) and xpath:
        try:
            xevents, xwhere = read_xplane(xpath)
            if len(xevents) > len(events) or not events:
                events, source, where = xevents, xpath, xwhere
        except Exception as e:  # an old jax without ProfileData
            print(f"  step_profile: could not read {xpath}: {e!r}", flush=True)
    if source is None:
        raise FileNotFoundError(f"no *.trace.json.gz or *.xplane.pb under {trace_dir}")
    mod = hlo.module
    per_cat = collections.Counter()
    per_op = collections.Counter()
    other_modules = collections.Counter()
    unmapped = collections.Counter()
    calls_time, n_mapped, n_unmapped = 0.0, 0, 0
    run_ids = set()
    kept = []  # this module's events
    t_lo, t_hi = float("inf"), float("-inf")
    for name, dur, ts, args in events:
        hm = str(args.get("hlo_module", ""))
        if hm and mod and not (hm == mod or hm.startswith(mod + "(") or hm.startswith(mod + ".")
                               or hm.split("(")[0] == mod):
            other_modules[hm] += dur
            continue
        kept.append((name, dur, ts, args))
        ins = _instr_of(hlo, name, args)
        if "run_id" in args:
            run_ids.add(str(args["run_id"]))
        t_lo, t_hi = min(t_lo, ts), max(t_hi, ts + dur)
        if ins is None:
            n_unmapped += 1
            unmapped[name[:60]] += dur
            per_cat[next((c for rx, c in KERNEL_RULES if rx.search(name)), REST)] += dur
            continue
        n_mapped += 1
        if hlo.instrs[ins].opcode in CALLERS:
            calls_time += dur
        per_cat[cats.get(ins, REST)] += dur
        per_op[ins] += dur
    n = steps or len(run_ids) or 1
    busy = sum(per_cat.values()) / n / 1e3
    gaps = _gaps(kept)
    return dict(source=source, where=where, module=mod, steps=n, run_ids=len(run_ids), step_ms=step_ms, busy_ms=busy,
                span_ms=(t_hi - t_lo) / n / 1e3 if n_mapped + n_unmapped else 0.0,
                ms={c: per_cat[c] / n / 1e3 for c in CATEGORIES},
                events=n_mapped + n_unmapped, unmapped_events=n_unmapped,
                unmapped_top=[(k, v / n / 1e3) for k, v in unmapped.most_common(5)],
                other_modules_ms={k: v / n / 1e3 for k, v in other_modules.most_common(5)},
                command_buffer_ms=calls_time / n / 1e3,
                gap_ms=sum(g for g, _, _ in gaps) / n / 1e3, gaps_top=[(g / 1e3, a, b) for g, a, b in gaps[:5]],
                top_ops={c: [(op, per_op[op] / n / 1e3, _describe(hlo, hlo.instrs[op]))
                             for op, _ in per_op.most_common() if cats.get(op) == c][:4] for c in CATEGORIES},
                counts={c: sum(1 for op in per_op if cats.get(op) == c) for c in CATEGORIES})


def _gaps(events: list) -> list:
    """Where the device had no event: (gap us, the event before, the event after), largest first, over the
    union of the events' intervals (within the traced span; the host's time between steps included)."""
    out, end, last = [], None, ""
    for name, dur, ts, _ in sorted(events, key=lambda e: e[2]):
        if end is not None and ts > end:
            out.append((ts - end, last[:50], name[:50]))
        if end is None or ts + dur > end:
            end, last = ts + dur, name
    return sorted(out, reverse=True)


def _describe(hlo: Hlo, ins: Instr) -> str:
    what = ins.target or ins.opcode
    if ins.opcode == "fusion":
        ops = collections.Counter(s.opcode for s in hlo.fused(ins) if s.opcode not in FREE)
        what = "fusion{" + ",".join(f"{k}" + (f"x{v}" if v > 1 else "") for k, v in ops.most_common(4)) + "}"
    tail = ins.op_name.split("/")[-2:] if ins.op_name else []
    return f"{what} {ins.type[:40]} {'/'.join(tail)}".strip()


def format_table(res: dict, title: str = "", top: bool = True) -> str:
    base = res["step_ms"] or res["busy_ms"] or 1.0
    lines = [f"{title}profile of {res['steps']} step(s) ({res['source']}; {res['where']}): {res['events']} events, "
             f"{res['unmapped_events']} not mapped to an HLO instruction of {res['module'] or '?'}; device busy "
             f"{res['busy_ms']:.3f} ms/step" + (f", timed step {res['step_ms']:.3f} ms" if res["step_ms"] else "")
             + (f" (run_ids seen: {res['run_ids']})" if res["run_ids"] and res["run_ids"] != res["steps"] else "")]
    lines.append(f"    {'category':<30} {'ms/step':>10} {'% step':>8}  ops")
    for c in CATEGORIES:
        ms = res["ms"][c]
        if ms == 0 and c not in (FP8_FPROP, FP8_DGRAD, FP8_WGRAD, OURS_Q, OURS_P, AROUND, REST):
            continue
        lines.append(f"    {c:<30} {ms:10.3f} {100 * ms / base:7.1f}%  {res['counts'][c]}")
    lines.append(f"    {'total (device busy)':<30} {res['busy_ms']:10.3f} {100 * res['busy_ms'] / base:7.1f}%")
    if res["step_ms"]:
        idle = res["step_ms"] - res["busy_ms"]
        lines.append(f"    {'step - busy (idle / overlap)':<30} {idle:10.3f} {100 * idle / base:7.1f}%")
    if res.get("span_ms"):
        lines.append(f"    traced span {res['span_ms']:.3f} ms/step, of it without any device event "
                     f"{res['gap_ms']:.3f} ms/step; largest gaps: " + "; ".join(
                         f"{g:.3f} ms after {a!r} before {b!r}" for g, a, b in res["gaps_top"][:3]))
    if res["command_buffer_ms"]:
        lines.append(f"    note: {res['command_buffer_ms']:.3f} ms/step mapped to call instructions (command buffers: "
                     "kernels inside them not told apart)")
    if res["other_modules_ms"]:
        lines.append("    left out (other modules): " + ", ".join(f"{k} {v:.3f} ms" for k, v in
                                                                   res["other_modules_ms"].items()))
    if res["unmapped_top"]:
        lines.append("    unmapped (in rest): " + ", ".join(f"{k} {v:.3f} ms" for k, v in res["unmapped_top"]))
    if top:
        for c in (AROUND, MOVE, REST, FLAX_Q):
            if res["top_ops"].get(c):
                lines.append(f"    top of {c}: " + "; ".join(f"{op} {ms:.3f} ms [{d}]" for op, ms, d in
                                                             res["top_ops"][c][:3]))
    return "\n".join(lines)


def report(trace_dir: str, hlo_text: str, steps: Optional[int] = None, step_ms: Optional[float] = None,
           title: str = "", out=print) -> Optional[dict]:
    """Analyze and print; None (after printing why) on any error: never raises."""
    try:
        res = analyze(trace_dir, hlo_text, steps, step_ms)
        out(format_table(res, title))
        try:
            with open(os.path.join(trace_dir, "step_profile.json"), "w") as f:
                json.dump(res, f, indent=1, default=str)
        except OSError:
            pass
        return res
    except Exception as e:  # noqa: BLE001  (the benchmark goes on)
        out(f"{title}step_profile failed: {e!r}\n" + "".join(traceback.format_exc(limit=4)))
        return None


def compare_table(results: dict, title: str = "") -> str:
    """One table: categories as rows, a column (ms/step) per variant (results: variant -> analyze's dict)."""
    vs = [v for v, r in results.items() if r]
    if not vs:
        return ""
    w = max(10, *(len(v) + 1 for v in vs))
    lines = [f"{title}device time per step (ms) by category:",
             f"    {'category':<30}" + "".join(f"{v:>{w}}" for v in vs)]
    for c in CATEGORIES:
        if any(results[v]["ms"][c] for v in vs):
            lines.append(f"    {c:<30}" + "".join(f"{results[v]['ms'][c]:{w}.3f}" for v in vs))
    lines.append(f"    {'device busy':<30}" + "".join(f"{results[v]['busy_ms']:{w}.3f}" for v in vs))
    if all(results[v]["step_ms"] for v in vs):
        lines.append(f"    {'timed step':<30}" + "".join(f"{results[v]['step_ms']:{w}.3f}" for v in vs))
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace_dir", help="the jax.profiler.trace directory (or a *.trace.json.gz / *.xplane.pb file)")
    ap.add_argument("--hlo", help="the compiled step's HLO text (default: TRACE_DIR/step.hlo.txt)")
    ap.add_argument("--steps", type=int, help="steps traced (default: distinct run_ids, else 1)")
    ap.add_argument("--step-ms", type=float, help="the timed step, for the %% column")
    ap.add_argument("--list", metavar="CATEGORY", help="also list every instruction of this category with its time")
    args = ap.parse_args(argv)
    hlo_path = args.hlo or os.path.join(args.trace_dir, "step.hlo.txt")
    with open(hlo_path) as f:
        text = f.read()
    res = report(args.trace_dir, text, args.steps, args.step_ms)
    if res and args.list:
        hlo = Hlo(text)
        cats = classify(hlo)
        for name, c in sorted(cats.items()):
            if c == args.list:
                print(f"  {name}: {_describe(hlo, hlo.instrs[name])}")
    if res is None:
        sys.exit(1)


if __name__ == "__main__":
    main()
