"""The report: every result as plain-text tables (printed) or Markdown (the results file)."""

from __future__ import annotations

from typing import Any

from .settings import TORCH_KINDS, TORCH_THREADS, variant_names
from .xla_stats import ops_diff


def _fmt(x: Any) -> str:
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


def table(headers: list[str], rows: list[list[Any]], markdown: bool = False) -> str:
    cells = [[_fmt(c) for c in row] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(row) + " |" for row in cells]
        return "\n".join(lines)
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def report(results: dict[str, Any], markdown: bool = False) -> str:
    out = []
    m = results["machine"]
    out.append(
        f"Machine: {m['cpu']}, {m['cores']} cores, backend {m['jax_backend']}, "
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items())
        + f"; torch threads {m['torch_threads']}."
    )
    head = "### " if markdown else ""
    for case_name, res in results["steps"].items():
        v = res["variants"]
        out.append(f"\n{head}Training step: {case_name} ({res['description']})\n")
        rows = []
        for name, _flavor, hooks in variant_names():
            row: list[Any] = [name, f"{v['jhooks ' + name]['step_s'] * 1e6:.0f}"]
            r = res["ratios"].get(f"jhooks {name} / jhooks plain")
            row.append(f"{r:.3f}" if r is not None else "1")
            for other in (*TORCH_KINDS, "torch.compile"):
                key = f"{other} {name}"
                if hooks == "idle":
                    row += ["", ""]
                elif key in v:
                    ratio = res["ratios"][f"jhooks {name} / {key}"]
                    row += [f"{v[key]['step_s'] * 1e6:.0f}", f"{ratio:.3f}"]
                else:
                    row += ["-", "-"]
            rows.append(row)
        out.append(
            table(
                [
                    "variant",
                    "jhooks µs",
                    "/ plain",
                    f"eager µs ({TORCH_THREADS}T)",
                    "jhooks / eager",
                    "eager µs (1T)",
                    "jhooks / eager 1T",
                    "compile µs (1T)",
                    "jhooks / compiled",
                ],
                rows,
                markdown,
            )
        )
        mem_rows = []
        plain = v["jhooks plain"]
        for name, _, _ in variant_names():
            s = v["jhooks " + name]
            mem_rows.append(
                [
                    name,
                    s["memory"]["temp_size"],
                    s["memory"]["argument_size"],
                    s["memory"]["output_size"],
                    sum(s["ops"].values()),
                    "same" if s["ops"] == plain["ops"] else ops_diff(s["ops"], plain["ops"]),
                    sum(s["lowered_ops"].values()),
                    "same"
                    if s["lowered_ops"] == plain["lowered_ops"]
                    else ops_diff(s["lowered_ops"], plain["lowered_ops"]),
                ]
            )
        out.append("")
        out.append(
            table(
                [
                    "variant",
                    "temp B",
                    "argument B",
                    "output B",
                    "optimized HLO ops",
                    "vs plain",
                    "lowered ops",
                    "vs plain",
                ],
                mem_rows,
                markdown,
            )
        )
        if res["torch_compile"]:
            out.append("")
            tc_rows = [
                [
                    n,
                    r["status"],
                    _fmt(r.get("compile_s", "-")),
                    r["graph_breaks"],
                    _fmt(r.get("grads_match_eager", "-")),
                ]
                for n, r in res["torch_compile"].items()
            ]
            out.append(
                table(
                    [
                        "torch.compile variant",
                        "status",
                        "compile s",
                        "graph breaks",
                        "grads = eager",
                    ],
                    tc_rows,
                    markdown,
                )
            )
        lc = res["loss_check"]
        out.append(
            f"\nFirst loss, same weights and batch: jax {lc['jax_loss']:.6f}, "
            f"torch {lc['torch_loss']:.6f}."
        )
    cost = results.get("compile_cost")
    if cost:
        out.append(f"\n{head}Compile cost (trace + lower + compile), MLP width 64\n")
        names = list(next(iter(cost.values())))
        rows = []
        for depth, row in cost.items():
            r = [depth]
            for n in names:
                r.append(f"{row[n]['total_s']:.2f}")
                if n != "plain":
                    r.append(f"{row[n]['ratio_to_plain']:.3f}")
            rows.append(r)
        headers = ["layers"]
        for n in names:
            headers.append(f"{n} s")
            if n != "plain":
                headers.append("/ plain")
        out.append(table(headers, rows, markdown))
    host = results.get("host_callback")
    if host:
        out.append(f"\n{head}Host callback cost (a tiny jitted function)\n")
        base = host["no callback"]["call_s"]
        out.append(
            table(
                ["function", "µs per call", "added µs"],
                [
                    [n, f"{r['call_s'] * 1e6:.0f}", f"{(r['call_s'] - base) * 1e6:.0f}"]
                    for n, r in host.items()
                ],
                markdown,
            )
        )
    if results.get("cache_memory"):
        from .cache_memory import HEADER as cache_memory_header

        out.append(
            f"\n{head}run_with_cache memory, MiB of temp + output (benchmarks/cache_memory.py)\n"
        )
        out.append(table(cache_memory_header, results["cache_memory"], markdown))
    if results.get("run_overhead"):
        from .run_overhead import report as run_overhead_report

        out.append(f"\n{head}run_with_hooks overhead and sweeps (benchmarks/run_overhead.py)\n")
        out.append(run_overhead_report(results["run_overhead"]))
    out.append(f"\n{head}Targets\n")
    out.append(
        table(
            ["target", "where", "value", "limit", "result"],
            [
                [
                    c["target"],
                    c["where"],
                    c["value"] if not isinstance(c["value"], float) else f"{c['value']:.3f}",
                    c["limit"],
                    "PASS" if c["pass"] else "MISS",
                ]
                for c in results["targets"]
            ],
            markdown,
        )
    )
    return "\n".join(out)
