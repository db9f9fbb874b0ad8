"""``popcompile check``: an engine folder's graphs against a deployment target (no GPU needed)."""
from __future__ import annotations

import json
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("check", help="check an engine folder's graphs against a deployment target",
                       description="Check every op, dtype, opset and dynamic dimension of both graphs "
                                   "against what the target's ONNX parser supports (no GPU needed).")
    p.add_argument("engine", type=Path, help="engine folder")
    p.add_argument("--target", choices=["tensorrt"], default="tensorrt", help="deployment target (tensorrt)")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.set_defaults(handler=cmd_check)


def cmd_check(args) -> None:
    from dataclasses import asdict

    from ..exporters.tensorrt_compat import check_engine, format_table

    report = check_engine(args.engine)
    if args.json:
        print(json.dumps({"ok": report.ok, "tensorrt_version": report.tensorrt_version,
                          "findings": [asdict(f) for f in (*report.failures, *report.warnings)]}))
    else:
        print(format_table(report))
    if not report.ok:
        raise SystemExit(1)
