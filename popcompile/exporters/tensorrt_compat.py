"""Will TensorRT's ONNX parser take our graphs? A check that runs without a GPU.

The support matrix is data: ``tensorrt_ops.json`` (onnx-tensorrt ``docs/operators.md`` for the pinned
TensorRT version: every op, its data types and its restrictions). ``check_model`` walks one ONNX graph
(external weights are not loaded: only the graph and the initializers' dtypes and shapes are read)
and reports, per op type:

    status        fails the check?  meaning
    unsupported   yes               the parser cannot import it: op absent or marked N, a domain other than
                                    the default ONNX one (onnxruntime's com.microsoft contrib ops), an opset
                                    below the parser's range, or a documented input/attribute it rejects
    dtype         yes               a tensor type the op does not support in TensorRT
    restriction   no (a warning)    a documented condition to keep in mind: an axes input that is computed
                                    rather than constant, DOUBLE cast down to FP32, If/Loop/Scan present,
                                    an opset above the parser's range, and the optimization-profile
                                    limits of the dynamic dimensions (``past`` can be 0, a profile cannot)
    ok            no                imported as is; the detail lists the dtypes seen

``check_engine(folder)`` runs it over both graphs of an engine folder; ``format_table`` prints the
result, failures first. (``engine.tensorrt.require_gpu()`` says in one line what to do when TensorRT
cannot run here.)

No torch import: this runs where only onnx is installed.
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

import onnx
from onnx import numpy_helper

from .tensorrt_rules import RESTRICTION_CHECKS

OPS_FILE = Path(__file__).with_name("tensorrt_ops.json")
FAILING = ("unsupported", "dtype")          # these make CompatReport.ok False
STATUS_ORDER = ("unsupported", "dtype", "restriction", "ok")
DEFAULT_DOMAINS = ("", "ai.onnx")

# ONNX element type name -> the names onnx-tensorrt's table uses
_TRT_DTYPE = {"FLOAT": "FP32", "FLOAT16": "FP16", "BFLOAT16": "BF16", "FLOAT8E4M3FN": "FP8",
              "FLOAT4E2M1": "FP4"}

# Inputs that TensorRT wants constant (initializer or Constant node, or foldable from them):
# op -> (input index, first opset where it is an input, what it is). Before that opset it is an attribute.
_CONSTANT_INPUTS = {
    "Slice": (3, 10, "axes"),
    "Squeeze": (1, 13, "axes"),
    "Unsqueeze": (1, 13, "axes"),
    "ReduceSum": (1, 13, "axes"),
    **{op: (1, 18, "axes") for op in (
        "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean",
        "ReduceMin", "ReduceProd", "ReduceSumSquare")},
    "CumSum": (1, 11, "axis"),
    "TopK": (1, 10, "K"),
    "OneHot": (1, 9, "depth"),
}
_NOT_FOLDABLE = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
                 "Bernoulli"}
_SUBGRAPH_OPS = ("If", "Loop", "Scan")


@dataclass(frozen=True)
class Finding:
    graph: str     # "prefill" | "decode" | whatever check_model was given
    op: str        # op type ("com.microsoft.GroupQueryAttention" outside the default domain), or
                   # "opset"/"profile"
    count: int     # nodes of that op with this finding
    status: str    # "ok" | "unsupported" | "dtype" | "restriction"
    detail: str


@dataclass(frozen=True)
class CompatReport:
    tensorrt_version: str
    source: str
    findings: tuple[Finding, ...]
    dims: dict = field(default_factory=dict)   # graph -> {input: [dynamic dim names]}

    @property
    def ok(self) -> bool:
        """True when no finding is "unsupported" or "dtype" ("restriction" only warns)."""
        return not self.failures

    @property
    def failures(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.status in FAILING)

    @property
    def warnings(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.status == "restriction")


@lru_cache(maxsize=1)
def support_matrix() -> dict:
    """The pinned TensorRT ONNX-parser support matrix (tensorrt_ops.json)."""
    return json.loads(OPS_FILE.read_text())


# --------------------------------------------------------------------------------------------- the check

def check_model(path_or_proto: str | Path | onnx.ModelProto, graph_name: str) -> list[Finding]:
    """Findings for one ONNX graph, one per (op, status, detail), sorted failures first."""
    model = _load(path_or_proto)
    matrix = support_matrix()
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # a graph shape inference cannot handle: check it with the types it declares
        inferred = model
    graph = inferred.graph
    opset = _default_opset(model)
    types = _types(graph)
    consts = _Constants(graph)
    functions = {(f.domain, f.name): f for f in model.functions}

    rows: dict[tuple[str, str, str], int] = defaultdict(int)
    seen_dtypes: dict[str, set[str]] = defaultdict(set)
    notes: dict[str, set[str]] = defaultdict(set)

    for node in _nodes(graph, functions, types, consts):
        op = node.op_type if node.domain in DEFAULT_DOMAINS else f"{node.domain}.{node.op_type}"
        problems = dict.fromkeys(_check_node(node, op, opset, matrix, types, consts, seen_dtypes, notes))
        for status, detail in problems or [("ok", "")]:
            rows[(op, status, detail)] += 1

    findings = [*_opset_findings(opset, matrix, graph_name), *_profile_findings(inferred, graph_name)]
    for (op, status, detail), count in rows.items():
        if status == "ok":
            entry = matrix["ops"].get(op, {})
            parts = [", ".join(sorted(seen_dtypes[op])) or "no typed tensors"]
            parts += sorted(notes[op])
            if entry.get("restrictions") and op not in _CONSTANT_INPUTS and op not in RESTRICTION_CHECKS:
                parts.append(f"unchecked TensorRT restriction: {entry['restrictions']}")
            detail = "; ".join(parts)
        findings.append(Finding(graph_name, op, count, status, detail))
    return sorted(findings, key=_sort_key)


def dynamic_dims(path_or_proto: str | Path | onnx.ModelProto) -> dict[str, list]:
    """``{input: [dynamic dimension names]}`` of every graph input: what optimization profiles must cover.

    Named dimensions (batch, seq, past, total) by name; an unnamed dynamic dimension as ``"dim{axis}"``.
    """
    model = _load(path_or_proto)
    initializers = {t.name for t in model.graph.initializer}
    dims: dict[str, list] = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        shape = value.type.tensor_type.shape
        dims[value.name] = [d.dim_param or f"dim{axis}" for axis, d in enumerate(shape.dim)
                            if not d.HasField("dim_value")]
    return dims


def check_engine(folder: str | Path) -> CompatReport:
    """Check both graphs of an engine folder (file names from its manifest; a vision-language engine's vision
    graph too) against the support matrix."""
    from google.protobuf.message import DecodeError

    from ..engine.manifest import RE_EXPORT, EngineManifest
    from ..engine.verify import HashCache, verify_file
    from ..errors import EngineError

    manifest = EngineManifest.read(folder)
    folder = Path(folder)
    findings: list[Finding] = []
    dims = {}
    entries = {name: (f"graphs.{name}.file", manifest.graphs[name]) for name in ("prefill", "decode")}
    vision = manifest.vision_section(folder)
    if vision is not None:
        entries["vision"] = ("vision.graph.file", SimpleNamespace(**vision.graph))
    for name, (key, entry) in entries.items():
        # inside the folder, the manifest's size and sha256 (docs/reliability.md)
        path = verify_file(folder, entry.file, key, entry.bytes, entry.sha256, HashCache(None))
        try:
            proto = _load(path)
        except (DecodeError, ValueError, OSError) as err:
            raise EngineError(f"{folder}: {entry.file} is not a readable ONNX graph ({err}): "
                              f"{RE_EXPORT}") from None
        findings += check_model(proto, name)
        dims[name] = dynamic_dims(proto)
    matrix = support_matrix()
    return CompatReport(matrix["tensorrt_version"], matrix["source"], tuple(sorted(findings, key=_sort_key)),
                        dims)


def format_table(report: CompatReport) -> str:
    """One row per (op, status, detail) over all graphs: op | graphs | count | status | detail; failures
    first."""
    merged: dict[tuple[str, str, str], list] = {}
    for f in report.findings:
        row = merged.setdefault((f.op, f.status, f.detail), [[], 0])
        if f.graph not in row[0]:
            row[0].append(f.graph)
        row[1] += f.count
    rows = [(op, ",".join(graphs), str(count), status, detail)
            for (op, status, detail), (graphs, count) in merged.items()]
    rows.sort(key=lambda r: (STATUS_ORDER.index(r[3]), r[0], r[1]))
    header = ("op", "graphs", "count", "status", "detail")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header[:4], widths)) + "  " + header[4]]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
    verdict = "ok" if report.ok else f"NOT ok: {len(report.failures)} failing finding(s)"
    lines.append(f"TensorRT {report.tensorrt_version} ONNX parser: {verdict}, "
                 f"{len(report.warnings)} warning(s) (unsupported and dtype fail; restriction warns)")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- per node

def _check_node(node, op, opset, matrix, types, consts, seen_dtypes, notes) -> list[tuple[str, str]]:
    """(status, detail) problems of one node; none means it imports as is."""
    if node.domain not in DEFAULT_DOMAINS:
        return [("unsupported", f"domain {node.domain!r} is not the default ONNX domain: "
                 + ("an onnxruntime contrib op, " if node.domain.startswith("com.microsoft") else "")
                 + "TensorRT imports it only through a registered plugin of that name, and none ships "
                   "for it")]
    entry = matrix["ops"].get(node.op_type)
    if entry is None:
        reason = matrix["not_supported_notes"].get(node.op_type, "not in the support matrix")
        return [("unsupported",
                 f"not supported by the TensorRT {matrix['tensorrt_version']} ONNX parser: {reason}")]
    problems: list[tuple[str, str]] = []
    problems += _dtype_problems(node, entry, opset, types, seen_dtypes)
    spec = _CONSTANT_INPUTS.get(node.op_type)
    if spec and opset >= spec[1]:
        index, _, what = spec
        if len(node.input) > index and node.input[index]:
            if consts.is_constant(node.input[index]):
                notes[node.op_type].add(f"{what} constant")
            else:
                problems.append(("restriction", _computed_input_detail(node.op_type, what, entry)))
    check = RESTRICTION_CHECKS.get(node.op_type)
    if check:
        problems += check(node, entry, consts, opset)
    return problems


def _computed_input_detail(op: str, what: str, entry: dict) -> str:
    doc = entry.get("restrictions") or "no restriction documented since TensorRT 10.3"
    return (f"`{what}` input is computed, not an initializer or Constant (TensorRT: {doc}); "
            f"fold it to a constant before parsing (popcompile keeps {what} constant)")


def _dtype_problems(node, entry, opset, types, seen_dtypes) -> list[tuple[str, str]]:
    allowed = set(entry["dtypes"])
    problems = []
    for name in _typed_tensors(node, opset):
        elem = types.get(name)
        if elem is None:
            continue
        dtype = _trt_dtype(elem)
        seen_dtypes[node.op_type].add(dtype)
        if dtype == "DOUBLE":
            problems.append(("restriction",
                             "DOUBLE tensors: TensorRT casts them down to FP32, clamping to +-FLT_MAX"))
            dtype = "FP32"
        if dtype not in allowed:
            problems.append(("dtype", f"{dtype} tensors; TensorRT {support_matrix()['tensorrt_version']} "
                                      f"supports {', '.join(entry['dtypes'])} for {node.op_type}"))
    return problems


def _typed_tensors(node, opset) -> list[str]:
    """The node's tensors that carry the op's data type (the T of its schema), not its indices or shapes."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        return []
    constraints = {c.type_param_str for c in schema.type_constraints}
    if node.op_type in ("Cast", "CastLike", "ConstantOfShape"):
        wanted = constraints
    elif "T" in constraints:
        wanted = {"T"}
    elif schema.inputs and schema.inputs[0].type_str in constraints:
        wanted = {schema.inputs[0].type_str}
    else:
        wanted = constraints
    names = []
    for params, values in ((schema.inputs, node.input), (schema.outputs, node.output)):
        for i, value in enumerate(values):
            if not value or not params:
                continue
            param = params[min(i, len(params) - 1)]
            if i >= len(params) and param.option != onnx.defs.OpSchema.FormalParameterOption.Variadic:
                continue
            if param.type_str in wanted:
                names.append(value)
    return names


def _trt_dtype(elem: int) -> str:
    name = onnx.TensorProto.DataType.Name(elem)
    return _TRT_DTYPE.get(name, name)


# --------------------------------------------------------------------------------------------- graph-level

def _opset_findings(opset: int, matrix: dict, graph: str) -> list[Finding]:
    lo, hi = matrix["min_opset"], matrix["max_opset"]
    span = f"TensorRT {matrix['tensorrt_version']} parses opsets {lo}..{hi}"
    if opset < lo:
        return [Finding(graph, "opset", 1, "unsupported",
                        f"default-domain opset {opset}: {span}; re-export with a newer opset")]
    if opset > hi:
        return [Finding(graph, "opset", 1, "restriction",
                        f"default-domain opset {opset}: {span}; ops newer than opset {hi} will not import")]
    return [Finding(graph, "opset", 1, "ok", f"default-domain opset {opset}: {span}")]


def _profile_findings(model: onnx.ModelProto, graph: str) -> list[Finding]:
    dims = dynamic_dims(model)
    names = sorted({d for ds in dims.values() for d in ds})
    if not names:
        return []
    findings = []
    others = [n for n in names if n != "past"]
    if others:
        findings.append(Finding(graph, "profile", 1, "ok",
                                f"dynamic dims {', '.join(others)}: each >= 1 at run time, "
                                "so an optimization profile [min 1, opt, max] covers it"))
    if "past" in names:
        inputs = [k for k, v in dims.items() if "past" in v]
        when = ("the first prefill of a conversation has past = 0" if graph == "prefill" else
                "decode runs with past = 0 on a one-token prompt and in --full mode (the runtime's "
                "first step, popcompile/runtime/loop.py)")
        findings.append(Finding(graph, "profile", len(inputs), "restriction",
            f"dim `past` ({len(inputs)} KV inputs) can be 0: {when}, but TensorRT optimization-profile dims "
            "must be >= 1, so no profile covers it. The TensorRT export must use a separate first-chunk "
            "engine/profile without past inputs for an empty cache, or a static "
            "[batch, kv_heads, max_seq, head_dim] cache buffer (TensorScatter, opset 24) with the fill "
            "length as an input, so past is never a dimension"))
    return findings


# --------------------------------------------------------------------------------------------- helpers

def _load(path_or_proto) -> onnx.ModelProto:
    if isinstance(path_or_proto, onnx.ModelProto):
        return path_or_proto
    return onnx.load(str(path_or_proto), load_external_data=False)


def _default_opset(model: onnx.ModelProto) -> int:
    for entry in model.opset_import:
        if entry.domain in DEFAULT_DOMAINS:
            return entry.version
    return 1


def _types(graph: onnx.GraphProto) -> dict[str, int]:
    """Element type of every named tensor: inputs, outputs, value_info, initializers, Constant outputs."""
    types: dict[str, int] = {}
    for value in [*graph.input, *graph.output, *graph.value_info]:
        if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
            types[value.name] = value.type.tensor_type.elem_type
    for tensor in graph.initializer:  # dtype and dims are in the proto; the data may be external, not read
        types[tensor.name] = tensor.data_type
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in DEFAULT_DOMAINS and node.output:
            elem = _constant_elem(node)
            if elem:
                types.setdefault(node.output[0], elem)
    return types


def _shapes(graph: onnx.GraphProto) -> dict[str, list]:
    """Shape of every tensor whose rank is known: ints for static dims, None for dynamic ones."""
    shapes: dict[str, list] = {}
    for value in [*graph.input, *graph.output, *graph.value_info]:
        tensor = value.type.tensor_type
        if value.type.HasField("tensor_type") and tensor.HasField("shape"):
            shapes[value.name] = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
    for tensor in graph.initializer:
        shapes[tensor.name] = list(tensor.dims)
    return shapes


def _constant_elem(node) -> int | None:
    for a in node.attribute:
        if a.name == "value":
            return a.t.data_type
        if a.name in ("value_float", "value_floats"):
            return onnx.TensorProto.FLOAT
        if a.name in ("value_int", "value_ints"):
            return onnx.TensorProto.INT64
        if a.name in ("value_string", "value_strings"):
            return onnx.TensorProto.STRING
    return None


def _nodes(graph, functions, types, consts):
    """Every node to import: the graph's, those inside If/Loop/Scan bodies, and local functions' bodies."""
    for node in graph.node:
        function = functions.get((node.domain, node.op_type))
        if function is not None:  # a model-local function: TensorRT inlines it, so its body is what counts
            yield from _nodes(onnx.helper.make_graph(list(function.node), function.name, [], []),
                              functions, types, consts)
            continue
        yield node
        for a in node.attribute:
            subgraphs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
            for sub in subgraphs:
                types.update({k: v for k, v in _types(sub).items() if k not in types})
                consts.add(sub)
                yield from _nodes(sub, functions, types, consts)


class _Constants:
    """Which tensors are build-time constants: initializers, Constant outputs, and what folds from them."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.initializers: dict[str, onnx.TensorProto] = {}
        self.producers: dict[str, onnx.NodeProto] = {}
        self.memo: dict[str, bool] = {}
        self.shapes: dict[str, list] = {}
        self.add(graph)

    def add(self, graph: onnx.GraphProto) -> None:
        self.initializers.update({t.name: t for t in graph.initializer})
        for name, dims in _shapes(graph).items():
            self.shapes.setdefault(name, dims)
        for node in graph.node:
            for out in node.output:
                self.producers.setdefault(out, node)

    def is_constant(self, name: str) -> bool:
        if name in self.memo:
            return self.memo[name]
        self.memo[name] = False  # cycles (malformed graphs) are not constant
        node = self.producers.get(name)
        if name in self.initializers:
            result = True
        elif node is None or node.op_type in _NOT_FOLDABLE or node.op_type in _SUBGRAPH_OPS:
            result = False
        else:
            result = all(self.is_constant(i) for i in node.input if i)
        self.memo[name] = result
        return result

    def value(self, name: str):
        """The numpy value of an initializer or Constant output stored inline; None otherwise."""
        tensor = self.initializers.get(name)
        node = self.producers.get(name)
        if tensor is None and node is not None and node.op_type == "Constant":
            tensor = next((a.t for a in node.attribute if a.name == "value"), None)
        if tensor is None or tensor.data_location == onnx.TensorProto.EXTERNAL:
            return None
        return numpy_helper.to_array(tensor)


def _sort_key(f: Finding):
    return (STATUS_ORDER.index(f.status), f.op, f.graph, f.detail)
