"""Writes one measured run (tests/suite_report.py's files) into docs/testing.md, between its two markers, and into
tests/suite_costs.json, which plans the next runs (tests/suite_plan.py).

    python tests/suite_table.py REPORT_DIR [docs/testing.md]

`make test-report` runs the whole suite with SUITE_REPORT_DIR set and then this."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from suite_plan import COSTS, write_costs

BEGIN, END = "<!-- suite-table:begin -->", "<!-- suite-table:end -->"


def load(report_dir: Path) -> tuple[dict, dict[str, dict], dict[str, float]]:
    """(the controller's record, {module: its measurements}, {test: its peak}) from one run's files."""
    records = {p.stem: json.loads(p.read_text()) for p in sorted(report_dir.glob("*.json"))}
    if "main" not in records:
        raise SystemExit(f"{report_dir}: no main.json (run the suite with SUITE_REPORT_DIR={report_dir})")
    workers = [r for name, r in records.items() if name != "main"] or [records["main"]]
    modules: dict[str, dict] = {}
    peaks: dict[str, float] = {}
    for record in workers:
        for module, m in record["modules"].items():
            if m["tests"]:
                modules[module] = {**m, "worker": record["worker"]}
        peaks.update(record.get("test_peaks", {}))
    return records["main"], modules, peaks


def table(main: dict, modules: dict[str, dict], peaks: dict[str, float] | None = None) -> str:
    rows = sorted(modules.items(), key=lambda kv: -kv[1]["seconds"])
    total_s = sum(m["seconds"] for _, m in rows)
    lines = [f"Measured by `make test-report`: {sum(m['tests'] for _, m in rows)} tests in {len(rows)} modules, "
             f"{main['wall_s'] / 60:.1f} minutes of wall time for {total_s / 60:.1f} minutes of tests; the run's "
             f"peak RSS {main['run_peak_mb'] / 1024:.1f} GB (every process of the suite, summed)"
             + (f", the machine's memory in use at most {main['machine_peak_mb'] / 1024:.1f} GB over its level before "
                "the run (each page once, containers included)." if main.get("machine_peak_mb") is not None else "."),
             "",
             "| module | tests | seconds | peak RSS (MB) | cores busy | worker |",
             "|---|---:|---:|---:|---:|---|"]
    for module, m in rows:
        busy = f"{m['busy_s'] / m['seconds']:.1f}" if m.get("busy_s") is not None and m["seconds"] >= 1 else ""
        lines.append(f"| `{module.removeprefix('tests/')}` | {m['tests']} | {m['seconds']:.0f} | {m['peak_mb']} | "
                     f"{busy} | {m['worker']} |")
    top = sorted((peaks or {}).items(), key=lambda kv: -kv[1])[:10]
    if top:  # where the run's memory goes: each test's own peak (its worker's process tree, summed)
        lines += ["", "The tests that peaked highest (their worker's process tree, summed RSS):", "",
                  "| test | peak RSS (MB) |", "|---|---:|"]
        lines += [f"| `{test.removeprefix('tests/')}` | {mb:.0f} |" for test, mb in top]
    return "\n".join(lines)


def main() -> None:
    report_dir = Path(sys.argv[1])
    doc = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).resolve().parents[1] / "docs" / "testing.md"
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc}: no {BEGIN} ... {END} section to fill")
    head, rest = text.split(BEGIN, 1)
    doc.write_text(f"{head}{BEGIN}\n{table(*load(report_dir))}\n{END}{rest.split(END, 1)[1]}")
    write_costs(report_dir)
    print(f"wrote the table of {report_dir} into {doc} and its costs into {COSTS}")


if __name__ == "__main__":
    main()
