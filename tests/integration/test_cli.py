"""The commands users run after a crash: ``lowdiff-recover`` and ``lowdiff inspect | verify | compact``."""

from __future__ import annotations

import copy
import importlib
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lowdiff_harness import Scenario, assert_state_equal, loss_for, make_model, train_run

import lowdiff
from lowdiff._recovery import cli

STEPS = 9
SCENARIO = Scenario(model="branch", optimizer="adamw", groups=2, clip=True, compressor="topk", ratio=0.25,
                    batch_steps=3, every_steps=4)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("cli") / "run"
    return root, train_run(SCENARIO, root, STEPS).refs


@pytest.fixture
def run(pristine, tmp_path: Path):
    d = tmp_path / "run"
    shutil.copytree(pristine[0], d)
    return d, pristine[1]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "import sys; from lowdiff._recovery.cli import main; "
                           "sys.exit(main(sys.argv[1:]))", *args], capture_output=True, text=True, timeout=timeout)


def test_recover_writes_the_exact_state_with_worker_processes(run, tmp_path: Path) -> None:
    root, refs = run
    out = tmp_path / "state.pt"
    p = _cli("recover", str(root), "--workers", "2", "--output", str(out))
    assert p.returncode == 0, p.stderr
    assert f"recovered step {STEPS} from snapshot 8 + 1 replayed steps" in p.stdout
    assert "mode parallel, workers 2" in p.stdout and f"wrote {out}" in p.stdout
    saved = torch.load(out, weights_only=True)
    assert saved["step"] == STEPS
    assert_state_equal(*refs[STEPS], lowdiff.recover(root, workers=1))
    for k, v in lowdiff.recover(root, workers=1).model.items():
        assert torch.equal(saved["model"][k], v), k


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_leaves_no_thread_that_would_stop_the_worker_processes(run, monkeypatch, capsys) -> None:
    """tqdm's monitor thread would make forking unsafe (recovery would fall back to one process)."""
    root, _ = run
    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    assert cli.recover_main([str(root), "--step", "7", "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "replaying" in err.getvalue()  # the bar was drawn
    assert "3/3" in err.getvalue(), err.getvalue()  # with its total (steps 5..7 from snapshot 4): an ETA
    assert "mode parallel, workers 2" in out, out


def test_progress_is_told_the_number_of_steps_to_replay(run) -> None:
    root, _ = run
    calls: list[tuple[str, int]] = []

    class Progress:
        def __call__(self, n: int) -> None:
            calls.append(("step", n))

        def set_total(self, total: int) -> None:
            calls.append(("total", total))

    lowdiff.recover(root, step=7, workers=1, progress=Progress())
    assert calls == [("total", 3)] + [("step", 1)] * 3


def test_inspect_and_verify_a_good_run(run) -> None:
    root, _ = run
    p = _cli("inspect", str(root))
    assert p.returncode == 0, p.stderr
    assert f"latest recoverable step: {STEPS}" in p.stdout and "snapshots: 3 at steps 0, 4, 8" in p.stdout
    p = _cli("verify", str(root))
    assert p.returncode == 0 and p.stdout.startswith("verify: OK"), p.stdout + p.stderr


def test_verify_names_a_damaged_file_and_fails(run) -> None:
    root, _ = run
    seg = sorted((root / "log").glob("steps-*.h5"))[-1]
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0xFF
    seg.write_bytes(bytes(data))
    p = _cli("verify", str(root))
    assert p.returncode == 1
    assert "BAD" in p.stdout and seg.name in p.stdout


def test_errors_are_one_line_naming_the_problem(tmp_path: Path) -> None:
    p = _cli("recover", str(tmp_path / "nowhere"))
    assert p.returncode == 2
    assert p.stderr.startswith("lowdiff recover: error:") and "nowhere" in p.stderr
    assert "Traceback" not in p.stderr


def test_a_file_given_as_the_run_directory_is_named_and_its_directory_suggested(run, capsys) -> None:
    root, _ = run
    for args, prog in ((["recover", str(root / "manifest.json")], "lowdiff recover"),
                       (["verify", str(root / "manifest.json")], "lowdiff verify")):
        assert cli.main(args) == 2
        err = capsys.readouterr().err
        assert err == f"{prog}: error: {root / 'manifest.json'} is not a directory; pass the directory holding it, " \
                      f"{root}\n", err
    assert cli.recover_main([str(next((root / "log").iterdir()))]) == 2
    assert "is not a directory; pass the run directory (the one holding manifest.json)" in capsys.readouterr().err


def test_verify_of_an_unreadable_manifest_says_nothing_else_was_checked(run) -> None:
    root, _ = run
    (root / "manifest.json").write_text("{bad")
    p = _cli("verify", str(root))
    assert p.returncode == 1
    assert p.stdout.startswith("BAD  ") and "not valid JSON" in p.stdout
    assert p.stdout.splitlines()[-1] == "verify: 1 problem; no snapshot, segment or stop file checked", p.stdout


def test_compact_refuses_a_url_naming_it_unchanged(capsys) -> None:
    assert cli.main(["compact", "s3://bucket/runs/exp1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lowdiff compact: error: compact works on a local run directory only, not "
                          "s3://bucket/runs/exp1:"), err
    assert "lowdiff-recover s3://bucket/runs/exp1" in err and err.count("\n") == 1


def test_compact_then_recover_is_still_exact(run) -> None:
    root, refs = run
    p = _cli("compact", str(root), "--keep", "1", "--workers", "2")
    assert p.returncode == 0, p.stderr
    assert f"compacted {root} at step {STEPS}: wrote a snapshot" in p.stdout
    assert [s.name for s in (root / "snapshots").glob("*.h5")] == [f"step-{STEPS:010d}.h5"]
    rec = lowdiff.recover(root, workers=1)
    assert rec.step == STEPS
    assert_state_equal(*refs[STEPS], rec)


def test_recover_refuses_an_output_inside_the_run_directory(run, capsys) -> None:
    """``--output`` naming one of the run's files (or any path under it) would replace it with the recovered
    state: refused before anything is read, and the file is left as it was."""
    root, _ = run
    for target in (next((root / "log").iterdir()), root / "manifest.json", root / "state.pt"):
        before = target.read_bytes() if target.exists() else None
        assert cli.recover_main([str(root), "--output", str(target)]) == 2
        err = capsys.readouterr().err
        assert "inside the run directory" in err, err
        assert (target.read_bytes() if target.exists() else None) == before


@pytest.mark.parametrize("args,message", [
    (["--output", "/nonexistent/dir/x.pt"], "directory /nonexistent/dir does not exist"),
    (["--workers", "0"], "--workers must be at least 1"),
    (["--step", "-1"], "--step must be 0 or more"),
], ids=["output-dir-missing", "workers-0", "negative-step"])
def test_recover_refuses_bad_arguments_before_any_work(tmp_path: Path, capsys, args: list[str],
                                                       message: str) -> None:
    """One line on stderr and exit status 2, before the run directory is even read: the directory given is not a
    run directory, so a command that looked at it first would fail with another message."""
    for main, prog in ((cli.recover_main, "lowdiff-recover"), (lambda argv: cli.main(["recover", *argv]),
                                                               "lowdiff recover")):
        assert main([str(tmp_path), *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"{prog}: error: ") and message in err, err


def test_a_run_of_an_optimizer_outside_torch_optim_needs_and_takes_optimizer_class(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """recover(), verify() and compact() take optimizer_class=; the commands had no way to pass it, so such a run
    could not be recovered, verified or compacted from the command line."""
    (tmp_path / "my_optim.py").write_text("import torch\n\n\nclass MySGD(torch.optim.SGD):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    my_optim = importlib.import_module("my_optim")  # written just above

    root = tmp_path / "run"
    model = make_model("mlp_bn", 0)
    inner = my_optim.MySGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = lowdiff.wrap(inner, model, {"run_dir": str(root), "snapshot": {"every_steps": 3},
                                      "log": {"batch_steps": 2}})
    opt.resume()
    for k in range(1, 6):
        loss_for("mlp_bn", model, k, 0).backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    ref = (copy.deepcopy(model.state_dict()), copy.deepcopy(inner.state_dict()))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", "import sys; from lowdiff._recovery.cli import main; "
                               "sys.exit(main(sys.argv[1:]))", *args], capture_output=True, text=True, timeout=120,
                              env=env)

    p = cli("recover", str(root))
    assert p.returncode == 2 and "--optimizer-class MODULE:CLASS" in p.stderr, p.stderr
    out = tmp_path / "state.pt"
    p = cli("recover", str(root), "--optimizer-class", "my_optim:MySGD", "--output", str(out))
    assert p.returncode == 0, p.stderr
    saved = torch.load(out, weights_only=True)
    assert saved["step"] == 5
    for k, v in ref[0].items():
        assert torch.equal(v, saved["model"][k]), k
    assert cli("verify", str(root), "--optimizer-class", "my_optim:MySGD").returncode == 0
    p = cli("compact", str(root), "--keep", "1", "--optimizer-class", "my_optim:MySGD")
    assert p.returncode == 0, p.stderr
    assert_state_equal(*ref, lowdiff.recover(root, optimizer_class=my_optim.MySGD))
    p = cli("recover", str(root), "--optimizer-class", "my_optim:Nope")
    assert p.returncode == 2 and "cannot import it" in p.stderr


def test_a_class_the_training_script_defined_is_named_by_a_module_defining_it(tmp_path: Path) -> None:
    """A class defined in the script run as `python train.py` is recorded as __main__.MySGD, a name no other program
    can import: --optimizer-class (and optimizer_class=) accept a class of the same name from any module."""
    cls = "import torch\n\n\nclass MySGD(torch.optim.SGD):\n    pass\n"
    (tmp_path / "my_optim.py").write_text(cls)
    (tmp_path / "train.py").write_text(cls + """
import sys
import lowdiff
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = lowdiff.wrap(MySGD(model.parameters(), lr=0.1), model, {"run_dir": sys.argv[1]})
opt.resume()
for _ in range(4):
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
opt.close()
""")
    root = tmp_path / "run"
    p = subprocess.run([sys.executable, str(tmp_path / "train.py"), str(root)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", "import sys; from lowdiff._recovery.cli import recover_main; "
                        "sys.exit(recover_main(sys.argv[1:]))", str(root), "--optimizer-class", "my_optim:MySGD"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    assert "step 4" in p.stdout, p.stdout
