"""The GPU check (``benchmarks/gpu_check.py``), its wheels and its page, exercised on the CPU.

The lent GPU machine has neither Ray, vLLM nor datasets: the check's quick CPU mode runs here in
a process where importing them fails, so ``import periodic_rl`` and a fit with in-process
rollouts are shown to need none of them, and its JSON is checked as the page generator reads
it. The pieces whose verdict matters (a failed case must not read as passed) are tested with a
deliberately wrong attention backend.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402 - the benchmarks folder is not a package
import gpu_check_attention  # noqa: E402
import gpu_check_report  # noqa: E402
import gpu_wheels  # noqa: E402
from gpu_check_common import Budget, CheckFailed, NotRun, Setting  # noqa: E402

#: Not on the lent GPU machine (and not carried there).
ABSENT = ("ray", "vllm", "datasets", "deepspeed", "flash_attn", "gguf")
RUNNER = """
import importlib.abc, importlib.util, runpy, sys
ABSENT = {absent!r}

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {{name!r}} (absent on the GPU machine)")
        return None

def find_spec(name, package=None, _find=importlib.util.find_spec):
    return None if name.partition(".")[0] in ABSENT else _find(name, package)

sys.meta_path.insert(0, Absent())
importlib.util.find_spec = find_spec  # what an availability check sees: not installed
sys.argv = {argv!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_without_absent(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """``benchmarks/gpu_check.py ARGS`` in a process where the :data:`ABSENT` packages fail to
    import."""
    argv = [str(REPO / "benchmarks" / "gpu_check.py"), *args]
    code = RUNNER.format(absent=ABSENT, argv=argv)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path_factory.mktemp("gpu-check")
    done = run_without_absent(
        "--out", str(out), "--device", "cpu", "--quick", "--commit", "test", timeout=600
    )
    path = out / "gpu_check.json"
    return done, json.loads(path.read_text()) if path.exists() else {}


def test_quick_cpu_run_passes_without_ray_vllm_or_datasets(quick: tuple) -> None:
    done, result = quick
    assert done.returncode == 0, done.stderr[-3000:]
    statuses = {c["name"]: c["status"] for c in result["checks"]}
    assert statuses == {
        "overlap": "passed",
        "packing": "passed",
        "probe": "passed",
        "deepspeed": "not-run",
        "benchmark": "passed",
    }, json.dumps(result["checks"], indent=1)[:3000]
    assert result["counts"] == {"passed": 4, "failed": 0, "not-run": 1}


def test_quick_json_records_numbers_and_what_could_not_run(quick: tuple) -> None:
    result = quick[1]
    checks = {c["name"]: c for c in result["checks"]}
    assert result["quick"] is True and result["commit"] == "test"
    assert result["environment"]["device"] == "cpu"
    assert "CUDA" in checks["deepspeed"]["reason"]
    overlap = checks["overlap"]["numbers"]
    assert overlap["same_completions"] and overlap["max_update"] > 1e-3
    assert overlap["max_param_diff"] <= 1e-5
    cases = checks["packing"]["numbers"]["cases"]
    assert {(c["dtype"], c["backend"]) for c in cases} == {
        ("fp32", "sdpa"),
        ("fp32", "split"),
        ("fp32", "flex"),
    }
    for case in cases:
        assert case["forward_status"] == "passed" and case["forward_logp_diff"] <= 1e-4
        if case["backend"] == "flex":  # no CPU backward: recorded, not silently skipped
            assert case["backward_status"] == "not-run" and "CPU" in case["reason"]
        else:
            assert case["backward_status"] == "passed" and case["backward_grad_rel_diff"] <= 1e-3
    probe = checks["probe"]["numbers"]["cases"]
    assert all(c["accepted"] and c["refused_broken"] for c in probe)
    rows = checks["benchmark"]["numbers"]["rows"]
    assert {r["layout"] for r in rows} == {"packed", "padded"}
    assert all(r["tokens_per_s"] > 0 for r in rows)


def test_page_reports_the_run(quick: tuple, tmp_path: Path) -> None:
    result = quick[1]
    source = tmp_path / "gpu_check.json"
    source.write_text(json.dumps(result))
    with pytest.raises(SystemExit):  # a quick run is not the GPU's page by accident
        gpu_check_report.main([str(source), "--output", str(tmp_path / "gpu.md")])
    gpu_check_report.main([str(source), "--output", str(tmp_path / "gpu.md"), "--allow-quick"])
    page = (tmp_path / "gpu.md").read_text()
    assert "**4 passed, 0 failed, 1 not run.**" in page and "`test`" in page
    for title, _ in gpu_check_report.SECTIONS.values():
        assert f"## {title}" in page
    assert "FAILED" not in page

    packing = next(c for c in result["checks"] if c["name"] == "packing")
    packing["status"], packing["error"] = "failed", "1 packing case(s) failed"
    packing["numbers"]["cases"][0]["forward_status"] = "failed"
    result["counts"] = {"passed": 3, "failed": 1, "not-run": 1}
    failed = gpu_check_report.page(result)
    assert "**3 passed, 1 failed, 1 not run.**" in failed
    assert failed.count("**FAILED**") == 2  # the summary row and the case


@pytest.fixture
def wrong_backend() -> str:
    """A backend that computes the sdpa result only without gradients (what the probe sees)
    and a shifted one under autograd: a packing mistake only training would meet."""
    from periodic_rl.attention import BACKENDS, register_backend

    sdpa = BACKENDS["sdpa"]

    def shifted(q, k, v, layout, opt):  # noqa: ANN001, ANN202
        out = sdpa.fn(q, k, v, layout, opt)
        return out + 0.5 if torch.is_grad_enabled() else out

    register_backend(dataclasses.replace(sdpa, name="gpu-check-wrong", fn=shifted))
    yield "gpu-check-wrong"
    BACKENDS.pop("gpu-check-wrong")


def test_a_wrong_packing_backend_fails_the_check(
    wrong_backend: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(gpu_check_attention, "BACKENDS", ("split", wrong_backend))
    setting = Setting(device=torch.device("cpu"), quick=True, workdir=str(tmp_path))
    with pytest.raises(CheckFailed) as failure:
        gpu_check_attention.check_packing(setting, Budget(300))
    cases = {c["backend"]: c for c in failure.value.numbers["cases"]}
    assert cases["split"]["status"] == "passed"
    assert cases[wrong_backend]["forward_status"] == "passed"  # no_grad: the probe's view
    assert cases[wrong_backend]["backward_status"] == "failed"
    assert cases[wrong_backend]["status"] == "failed"
    assert failure.value.numbers["counts"] == {"passed": 1, "failed": 1, "not-run": 0}


def _check(name: str, fn) -> gpu_check.Check:  # noqa: ANN001
    return gpu_check.Check(name, "a check", fn, seconds=10.0)


def test_each_outcome_is_recorded_and_the_benchmark_needs_time(tmp_path: Path) -> None:
    setting = Setting(device=torch.device("cpu"), quick=True, workdir=str(tmp_path))

    def failed(setting: Setting, budget: Budget) -> dict:
        raise CheckFailed("off by 1", {"diff": 1.0})

    def missing(setting: Setting, budget: Budget) -> dict:
        raise NotRun("no deepspeed")

    def broken(setting: Setting, budget: Budget) -> dict:
        raise RuntimeError("boom")

    def passed(setting: Setting, budget: Budget) -> dict:
        assert budget.seconds <= 10.0  # its share, not the whole budget
        return {"x": 1}

    plenty = Budget(300)
    rows = [gpu_check.run_check(_check(n, f), setting, plenty) for n, f in
            [("a", failed), ("b", missing), ("c", broken), ("d", passed)]]  # fmt: skip
    assert [r["status"] for r in rows] == ["failed", "not-run", "failed", "passed"]
    assert rows[0]["numbers"] == {"diff": 1.0} and rows[1]["reason"] == "no deepspeed"
    assert rows[2]["error"] == "RuntimeError: boom" and rows[3]["numbers"] == {"x": 1}
    short = Budget(gpu_check.BENCHMARK_MINIMUM - 1)
    assert gpu_check.run_check(_check("benchmark", passed), setting, short)["status"] == "not-run"
    assert gpu_check.run_check(_check("e", passed), setting, Budget(0))["status"] == "not-run"


def test_wheels_command_and_requirements(monkeypatch: pytest.MonkeyPatch) -> None:
    line = gpu_wheels.command([REPO / ".gpu_wheels" / "x-1-py3-none-any.whl"])
    assert len(line) < gpu_wheels.COMMAND_LIMIT
    assert "--no-index --no-deps .gpu_wheels/x-1-py3-none-any.whl" in line
    assert "benchmarks/gpu_check.py --out $OUT --commit " in line
    assert gpu_wheels.unmet_on_machine("transformers") == []  # the machine's hub and tokenizers
    monkeypatch.setitem(gpu_wheels.MACHINE, "huggingface-hub", "0.30.0")
    assert any("huggingface" in p for p in gpu_wheels.unmet_on_machine("transformers"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA checks need a CUDA GPU")
def test_cuda_packing_and_probe(tmp_path: Path) -> None:
    done = run_without_absent(
        "--out", str(tmp_path), "--only", "packing", "probe", "--budget", "300", timeout=600
    )
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert done.returncode == 0, json.dumps(result["checks"], indent=1)[:3000]
    assert result["counts"] == {"passed": 2, "failed": 0, "not-run": 0}
