"""Child process of test_kill9.py: trains a scenario and prints ``STEP DURABLE_STEP`` after every step.

    python kill9_child.py RUN_DIR SCENARIO_JSON STEPS

It never closes the optimizer: after the last step it sleeps until the parent kills it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: lowdiff_harness

from lowdiff_harness import Scenario, start  # noqa: E402


def main() -> None:
    run_dir, scenario_json, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    scenario = Scenario(**json.loads(scenario_json))
    t = start(scenario, run_dir)
    print(f"START {t.opt.step_count} {t.opt.durable_step}", flush=True)
    for k in range(t.opt.step_count + 1, steps + 1):
        t.step(k)
        print(f"{k} {t.opt.durable_step}", flush=True)
        time.sleep(0.003)  # spread the steps out so kills land at many different points
    print("DONE", flush=True)
    time.sleep(120)


if __name__ == "__main__":
    main()
