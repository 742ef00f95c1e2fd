"""How the suite runs on two cores and 24 GB: which tests are quick, in what order modules start, and which
modules never run beside each other. Everything comes from `tests/suite_costs.json`, the last measured run
(`make test-report` rewrites it): per module its seconds and peak memory, per test its seconds.

- **Quick tier.** A test measured at `QUICK_S` seconds or more is marked `slow`; `make test-quick` runs the rest
  (`-m "not slow"`). A test not measured yet counts as quick until the next `make test-report`.
- **Order.** Modules start longest first (LPT: the long ones do not end up alone at the end of a two-worker run);
  tests keep their order within a module.
- **Lanes.** Modules whose measured peak is `HEAVY_MB` or more (they start engine servers, trainer ranks or model
  copies) form one xdist unit, the heavy lane: they run one after another on one worker, while the other worker
  takes the rest, module by module. So at most one heavy module runs at a time, and the run's memory is bounded by
  the largest heavy module beside the largest light one (docs/testing.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

COSTS = Path(__file__).with_name("suite_costs.json")
QUICK_S = 2.0
HEAVY_MB = 6000
HEAVY_LANE = "heavy-lane"


def load_costs(path: Path = COSTS) -> dict:
    """{"modules": {module: {"seconds", "peak_mb"}}, "tests": {test id: seconds}, "test_peaks": {test id: MB}};
    empty where never measured."""
    costs = json.loads(path.read_text()) if path.is_file() else {}
    return {"modules": {}, "tests": {}, "test_peaks": {}, **costs}


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def heavy_modules(costs: dict) -> set[str]:
    return {m for m, c in costs["modules"].items() if c.get("peak_mb", 0) >= HEAVY_MB}


class SuitePlan:
    """Registered by conftest.py in every pytest process (the ordering must be the same in all of xdist's workers,
    which check that they collected the same list)."""

    def __init__(self, costs: dict) -> None:
        self.costs = costs
        self.heavy = heavy_modules(costs)

    def _module_seconds(self, module: str) -> float:
        return self.costs["modules"].get(module, {}).get("seconds", 0.0)

    @pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        tests = self.costs["tests"]
        for item in items:
            if tests.get(item.nodeid, 0.0) >= QUICK_S:
                item.add_marker(pytest.mark.slow)
        heavy_s = sum(self._module_seconds(m) for m in self.heavy)

        def key(item: pytest.Item) -> float:
            module = module_of(item.nodeid)
            return -(heavy_s if module in self.heavy else self._module_seconds(module))

        items.sort(key=key)  # stable: a module's tests keep their order, modules stay together

    @pytest.hookimpl(optionalhook=True)  # an xdist hook: absent when xdist is not loaded
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log):
        if config.getoption("dist") != "loadfile":
            return None
        from xdist.scheduler import LoadFileScheduling

        heavy = self.heavy

        class LaneScheduling(LoadFileScheduling):
            """xdist's per-file units, but the heavy modules as one unit, in the collection's (LPT) order."""

            def _split_scope(self, nodeid: str) -> str:
                module = module_of(nodeid)
                return HEAVY_LANE if module in heavy else module

        config.option.loadscopereorder = False  # keep the LPT order of the collection
        return LaneScheduling(config, log)


def write_costs(report_dir: Path, path: Path = COSTS) -> dict:
    """suite_costs.json from one measured run's files (tests/suite_report.py), sorted so that diffs read well."""
    records = [json.loads(p.read_text()) for p in sorted(report_dir.glob("*.json")) if p.stem != "main"]
    if not records:  # a run without workers
        records = [json.loads((report_dir / "main.json").read_text())]
    modules, tests, peaks = {}, {}, {}
    for record in records:
        for module, m in record["modules"].items():
            if m["tests"]:
                modules[module] = {"seconds": m["seconds"], "peak_mb": m["peak_mb"]}
        tests.update(record.get("tests", {}))
        peaks.update(record.get("test_peaks", {}))
    costs = {"modules": dict(sorted(modules.items())), "tests": dict(sorted(tests.items())),
             "test_peaks": dict(sorted(peaks.items()))}
    path.write_text(json.dumps(costs, indent=1) + "\n")
    return costs
