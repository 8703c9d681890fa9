"""Runs the forged cases (cases.py), each in a forked child under a memory limit and a timeout, and prints one
JSON object per case: its category (ok, silently-wrong, hang, non-lowdiff-exception, over-allocation,
unexpected, verify-missed) with the details.

    python tests/hostile/runner.py WORKDIR [CASE ...]

A separate process (not pytest's): forking is safe only without other threads, and a case that hangs or
allocates without bound must not take the test process with it. The pristine runs are trained here once; every
child inherits them and their reference states.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import resource
import select
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import torch  # noqa: E402
from cases import BY_NAME, CASES, STEPS, Case, Ctx  # noqa: E402
from lowdiff_harness import Scenario, assert_state_equal, train_run  # noqa: E402

import lowdiff  # noqa: E402
from lowdiff import errors  # noqa: E402
from lowdiff._recovery import cli  # noqa: E402

CASE_TIMEOUT_S = float(os.environ.get("LOWDIFF_FORGED_TIMEOUT_S", "60"))
ADDRESS_SPACE_HEADROOM_BYTES = 1 << 30
"""RLIMIT_AS of a child: its address space at the fork plus this; a larger allocation fails there."""
SLACK_BYTES = 8 << 20
"""Resident growth allowed beyond the control case's own (a recovery and a verify of the untouched run: ~26 MiB
here, the interpreter's working set) plus 2x the model's state: what reading a second snapshot, formatting an
error and the like may add. A forged size that got allocated would show as hundreds of MiB to GiB."""
DEFAULT_BASELINE_BYTES = 40 << 20
"""The control's growth when it is not run (a subset of cases was asked for)."""

BASE = Scenario(model="mlp_bn", optimizer="adamw", groups=2, compressor="topk", ratio=0.25, batch_steps=3,
                every_steps=4, codec="zstd", clip=True, scheduler=True)
OTHERS = {"same": {"seed": 1}, "sgd": {"optimizer": "sgd"}, "powersgd": {"compressor": "powersgd", "rank": 2}}
GOLDEN = HERE.parent / "data" / "golden-2.0"


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _state_bytes(ref: tuple[dict[str, Any], dict[str, Any]]) -> int:
    total = sum(t.nbytes for t in ref[0].values())
    for st in ref[1]["state"].values():
        total += sum(v.nbytes for v in st.values() if isinstance(v, torch.Tensor))
    return total


def _memoryish(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or "alloc" in str(e).lower() or "memory" in str(e).lower()


def _outcome(fn: Any) -> dict[str, Any]:
    try:
        return {"outcome": "ok", "value": fn()}
    except errors.LowDiffError as e:
        return {"outcome": "lowdiff", "error": e, "type": type(e).__name__, "message": str(e)}
    except BaseException as e:  # noqa: BLE001 - classifying exactly these is the point
        return {"outcome": "memory" if _memoryish(e) else "other", "type": type(e).__name__,
                "message": str(e)[:2000], "traceback": traceback.format_exc()[-4000:]}


def _verify(run_dir: Path) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["verify", str(run_dir)])
    return code, out.getvalue() + err.getvalue()


def _classify(case: Case, run_dir: Path, refs: dict[int, Any], rec: dict[str, Any], ver: dict[str, Any]
              ) -> tuple[str, str]:
    for what, res in (("recover", rec), ("verify", ver)):
        if res["outcome"] == "memory":
            return "over-allocation", f"{what}: {res['type']}: {res['message']}"
        if res["outcome"] == "other":
            return "non-lowdiff-exception", f"{what}: {res['type']}: {res['message']}\n{res['traceback']}"
    exp = case.expect
    if rec["outcome"] == "ok":
        r = rec["value"]
        try:
            assert_state_equal(*refs[r.step], r)
        except (AssertionError, KeyError) as e:
            return "silently-wrong", f"recovered step {r.step} from snapshot {r.report.snapshot_step}: {e}"[:2000]
        got = f"step {r.step} from snapshot {r.report.snapshot_step}, skipped {r.report.skipped}"
        if exp.kind != "exact":
            return "unexpected", f"expected a refusal naming {exp.names}, got {got}"
        if r.step != exp.step or (exp.snapshot is not None and r.report.snapshot_step != exp.snapshot):
            return "unexpected", f"expected step {exp.step} from snapshot {exp.snapshot}, got {got}"
        missing = [s for s in exp.skipped if not any(s in line for line in r.report.skipped)]
        if missing or (not exp.skipped and r.report.skipped):
            return "unexpected", f"expected skipped {list(exp.skipped)}, got {got}"
    else:
        e = rec["error"]
        if exp.kind != "refuse":
            return "unexpected", f"expected step {exp.step}, got {rec['type']}: {rec['message']}"
        cls = getattr(errors, exp.error)
        if not isinstance(e, cls) or (exp.names and exp.names not in str(e)):
            return "unexpected", f"expected {exp.error} naming {exp.names}, got {rec['type']}: {rec['message']}"
    code, text = ver["value"]
    flagged = case.verify_names()
    if flagged is None:
        if code != 0:
            return "verify-missed", f"verify of a sound run exited {code}: {text[-1500:]}"
    elif code != 1 or (flagged and flagged not in text):
        return "verify-missed", f"verify exited {code} (expected 1 naming {flagged!r}): {text[-1500:]}"
    return "ok", ""


def _child(case: Case, run_dir: Path, refs: dict[int, Any], bound: int, wfd: int) -> None:
    code = 0
    try:
        torch.set_num_threads(1)
        resource.setrlimit(resource.RLIMIT_AS, (_status("VmSize") + ADDRESS_SPACE_HEADROOM_BYTES,
                                                resource.getrlimit(resource.RLIMIT_AS)[1]))
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
        start = _status("VmRSS")
        rec = _outcome(lambda: lowdiff.recover(run_dir, step=case.target, workers=case.workers))
        ver = _outcome(lambda: _verify(run_dir))
        peak = _status("VmHWM") - start
        category, detail = _classify(case, run_dir, refs, rec, ver)
        if category in ("ok", "unexpected", "verify-missed") and peak > bound:
            category, detail = "over-allocation", f"resident memory grew by {peak >> 20} MiB (bound {bound >> 20})"
        summary = {k: v for k, v in rec.items() if k in ("outcome", "type", "message")}
        if rec["outcome"] == "ok":
            r = rec["value"]
            summary["value"] = {"step": r.step, "snapshot": r.report.snapshot_step, "skipped": r.report.skipped}
        out = {"category": category, "detail": detail, "peak_growth_bytes": peak, "recover": summary,
               "verify_exit": ver["value"][0] if ver["outcome"] == "ok" else None}
        data = pickle.dumps(json.loads(json.dumps(out, default=str)))
        view = memoryview(data)
        while view:
            view = view[os.write(wfd, view):]
    except BaseException:
        code = 1
        with contextlib.suppress(BaseException):
            os.write(wfd, pickle.dumps({"category": "runner-error", "detail": traceback.format_exc()}))
    finally:
        os._exit(code)


def run_case(case: Case, bases: dict[str, tuple[Path, dict[int, Any]]], others: dict[str, Path],
             work: Path, baseline: int = DEFAULT_BASELINE_BYTES) -> dict[str, Any]:
    base, refs = bases[case.base]
    root = work / case.name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    run_dir, scratch = root / "run", root / "scratch"
    shutil.copytree(base, run_dir, symlinks=True)
    scratch.mkdir()
    try:
        case.forge(Ctx(run_dir, others, scratch))
    except Exception:
        return {"category": "forge-error", "detail": traceback.format_exc()}
    bound = baseline + 2 * _state_bytes(refs[max(refs)]) + SLACK_BYTES
    rfd, wfd = os.pipe()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        _child(case, run_dir, refs, bound, wfd)
    os.close(wfd)
    chunks: list[bytes] = []
    deadline = t0 + CASE_TIMEOUT_S
    hung = False
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            hung = True
            break
        ready, _, _ = select.select([rfd], [], [], left)
        if ready:
            b = os.read(rfd, 1 << 20)
            if not b:
                break
            chunks.append(b)
    if hung:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(rfd)
    seconds = time.perf_counter() - t0
    if hung:
        return {"category": "hang", "detail": f"no result within {CASE_TIMEOUT_S:.0f} s", "seconds": seconds}
    if not chunks:
        return {"category": "over-allocation", "detail": "the child died without a result (killed for memory?)",
                "seconds": seconds}
    out = pickle.loads(b"".join(chunks))
    out["seconds"] = seconds
    out["bound_bytes"] = bound
    if out["category"] == "ok":
        shutil.rmtree(root, ignore_errors=True)
    return out


def prepare(work: Path) -> tuple[dict[str, tuple[Path, dict[int, Any]]], dict[str, Path]]:
    torch.set_num_threads(1)
    bases: dict[str, tuple[Path, dict[int, Any]]] = {}
    t = train_run(BASE, work / "pristine" / "run", STEPS)
    bases["pristine"] = (work / "pristine" / "run", t.refs)
    others = {}
    for name, changes in OTHERS.items():
        d = work / f"other-{name}" / "run"
        train_run(Scenario(**{**BASE.to_dict(), **changes}), d, STEPS)
        others[name] = d
    golden = work / "golden" / "run"
    shutil.copytree(GOLDEN / "run", golden)
    bases["golden"] = (golden, torch.load(GOLDEN / "expected.pt", weights_only=True))
    # Warm up in this process (lazy imports, codec modules): the children's memory growth is then the case's own.
    lowdiff.recover(bases["pristine"][0], workers=1)
    _verify(bases["pristine"][0])
    return bases, others


def main(argv: list[str]) -> int:
    work = Path(argv[0])
    names = argv[1:] or [c.name for c in CASES]
    bases, others = prepare(work)
    results = {}
    baselines: dict[str, int] = {}
    controls = [c.name for c in CASES if c.issue == "control" and c.name in names]
    for name in controls + [n for n in names if n not in controls]:
        case = BY_NAME[name]
        res = run_case(case, bases, others, work / "cases", baselines.get(case.base, DEFAULT_BASELINE_BYTES))
        if case.issue == "control" and res["category"] == "ok":
            baselines[case.base] = res["peak_growth_bytes"]
        res["issue"] = BY_NAME[name].issue
        results[name] = res
        print(json.dumps({"case": name, **res}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
