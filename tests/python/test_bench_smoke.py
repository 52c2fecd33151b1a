"""The benchmark harness's plumbing, end to end on the CPU: `bench.run --smoke` (1 and 2 processes) and `bench.render`.

Also checks that the harness catches a wrong implementation and survives one that raises, using
two impls plugged in from outside the package (MOK_BENCH_EXTRA_IMPLS).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

TOP_LEVEL_FIELDS = ("device", "num_gpus", "commit", "command", "torch", "cuda", "ceilings", "cases")
CEILING_FIELDS = ("bf16_tflops", "hbm_gbps", "nvlink_read_gbps", "nvlink_write_gbps")
ROW_FIELDS = (
    "preset", "ranks", "tokens_per_rank", "precision", "pass", "routing", "impl",
    "median_ms", "tflops", "floor_ms", "correct", "status", "kind",
)

TEST_IMPLS = textwrap.dedent(
    '''
    """Test impls: one returns a wrong output, one raises while building, and symm_a2a's
    dispatch/combine logic running over an all_to_all_vdev emulated with gloo (the real op needs
    NVSHMEM GPUs)."""
    import torch
    import torch.distributed as dist

    from bench.impls import autograd_runner, register_impl
    from bench.impls import symm_a2a
    from bench.impls.torch_a2a import build as torch_a2a_build


    class GlooWorkspace(symm_a2a.SymmWorkspace):
        """Plain CPU buffers; exchange() has all_to_all_vdev's contract, done with all_to_all_single."""

        def __init__(self, runtime, capacity_bytes):
            self.runtime = runtime
            numel = max(capacity_bytes // 2, symm_a2a.MIN_BUFFER_BYTES) // 2
            self.send = torch.zeros(numel, dtype=torch.bfloat16)
            self.recv = torch.zeros(numel, dtype=torch.bfloat16)
            self.capacity_bytes = 2 * numel * 2

        def exchange(self, width, in_splits, recv_rows):
            recv_counts = torch.empty_like(in_splits)
            dist.all_to_all_single(recv_counts, in_splits)
            sends, recvs = in_splits.tolist(), recv_counts.tolist()
            send, recv = self._rows(self.send, width), self._rows(self.recv, width)
            dist.all_to_all_single(recv[: sum(recvs)], send[: sum(sends)], recvs, sends)
            return recv[:recv_rows], recv_counts


    @register_impl("symm_a2a_gloo_emulated", "layer", is_baseline=False)
    def build_symm_emulated(problem, ctx):
        need = symm_a2a.workspace_bytes_for(problem.case, problem.preset)
        return symm_a2a.layer_runner(problem, GlooWorkspace(ctx.runtime, need))


    @register_impl("wrong_output_for_test", "layer", is_baseline=False)
    def build_wrong(problem, ctx):
        inner = torch_a2a_build(problem, ctx)
        return autograd_runner(problem, lambda: inner.forward() * 1.1)


    @register_impl("raises_for_test", "layer", is_baseline=False)
    def build_raising(problem, ctx):
        raise RuntimeError("deliberate failure")
    '''
)


def _env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "bench_test_impls.py").write_text(TEST_IMPLS)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(tmp_path)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["MOK_BENCH_EXTRA_IMPLS"] = "bench_test_impls"
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd: list[str], env: dict[str, str]) -> None:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"


def _check_results(path: Path, ranks: int) -> dict:
    doc = json.loads(path.read_text())
    for field in TOP_LEVEL_FIELDS:
        assert field in doc, field
    assert doc["num_gpus"] == 0 and doc["world_size"] == ranks
    assert doc["ceilings"]["measured_on"] == "cpu"
    for field in CEILING_FIELDS:
        assert field in doc["ceilings"], field
    assert doc["ceilings"]["bf16_tflops"] > 0 and doc["ceilings"]["nvlink_read_gbps"] is None
    assert "bench.run" in doc["command"]
    rows = doc["cases"]
    assert rows and all(r["ranks"] == ranks for r in rows)
    for row in rows:
        for field in ROW_FIELDS:
            assert field in row, (field, row)
        if row["status"] == "skipped":
            assert row["skip_reason"]
    ran = [r for r in rows if r["status"] == "ok" and r["baseline"]]
    assert {r["impl"] for r in ran} >= {"torch_a2a"}
    for row in ran:
        assert row["correct"] is True, row
        assert row["median_ms"] > 0 and row["tflops"] > 0 and row["floor_ms"] > 0
        assert max(row["check_errors"].values()) <= row["tolerance"]
    assert {r["pass"] for r in ran} == {"forward", "backward", "both"}
    assert {r["routing"] for r in ran} >= {"balanced", "zipf", "all_to_one"}

    wrong = [r for r in rows if r["impl"] == "wrong_output_for_test"]
    assert wrong and all(r["correct"] is False for r in wrong)
    raising = [r for r in rows if r["impl"] == "raises_for_test"]
    assert raising and all(r["status"] == "error" and "deliberate failure" in r["error"] for r in raising)
    for impl in ("symm_a2a", "deepep", "mok"):
        assert all(r["status"] == "skipped" for r in rows if r["impl"] == impl), impl
    emulated = [r for r in rows if r["impl"] == "symm_a2a_gloo_emulated"]
    assert emulated and all(r["status"] == "ok" and r["correct"] is True for r in emulated), emulated
    assert path.with_suffix(".log").stat().st_size > 0
    return doc


def test_smoke_single_process_and_render(tmp_path: Path) -> None:
    env = _env(tmp_path)
    out = tmp_path / "smoke1.json"
    _run([sys.executable, "-m", "bench.run", "--cases", "smoke:ranks=1", "--smoke", "--out", str(out)], env)
    doc = _check_results(out, ranks=1)
    experts = [r for r in doc["cases"] if r["kind"] == "experts" and r["impl"] == "torch_grouped_mm"]
    assert experts and all(r["status"] == "ok" and r["correct"] for r in experts)

    _run([sys.executable, "-m", "bench.render", str(out)], env)
    md = (tmp_path / "smoke1.md").read_text()
    assert "| torch_a2a |" in md and "| torch_grouped_mm |" in md and "**NO**" in md
    pngs = sorted(tmp_path.glob("smoke1_*.png"))
    assert any("throughput" in p.name for p in pngs) and any("vs_best" in p.name for p in pngs)
    assert all(p.stat().st_size > 1000 for p in pngs)


def test_smoke_two_processes_gloo(tmp_path: Path) -> None:
    env = _env(tmp_path)
    out = tmp_path / "smoke2.json"
    _run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "bench.run", "--cases", "smoke:ranks=2", "--smoke", "--out", str(out)],
        env,
    )
    doc = _check_results(out, ranks=2)
    remote = [r for r in doc["cases"] if r["impl"] == "torch_a2a" and r["status"] == "ok"]
    assert all(r["nvlink_bytes"] > 0 for r in remote if r["routing"] != "all_to_one") or not remote
    assert all(len(r["rank_median_ms"]) == 2 for r in remote)


def test_studies_run_only_when_named() -> None:
    """mok_domains (the several-domains path against the one-domain megakernel) is a study: the
    benchmark of record (no --impls) leaves it out, naming it runs it."""
    sys.path.insert(0, str(REPO))
    from bench.impls import impls_for, load_impls

    load_impls()
    assert "mok_domains" not in {s.name for s in impls_for("layer")}
    assert {"mok", "torch_a2a"} <= {s.name for s in impls_for("layer")}
    assert [s.name for s in impls_for("layer", ["mok", "mok_domains"])] == ["mok", "mok_domains"]


def test_case_tables_are_well_formed() -> None:
    sys.path.insert(0, str(REPO))
    from bench.cases import TABLES, select_cases
    from bench.presets import PRESETS

    assert set(TABLES) >= {"smoke", "baselines_1gpu", "baselines_2gpu", "experts_1gpu"}
    b2 = TABLES["baselines_2gpu"]
    assert {c.preset for c in b2} >= set(PRESETS) - {"small", "tiny"}
    assert {c.tokens_per_rank for c in b2 if c.routing == "balanced"} == {2048, 8192, 32768}
    assert all(c.ranks == 2 for c in b2)
    assert {c.routing for c in b2} == {"balanced", "zipf", "all_to_one"}
    for ranks in (4, 8):  # the nvidia-h200-x4 / -x8 tables: the same cases, experts split R ways
        table = TABLES[f"baselines_{ranks}gpu"]
        assert len(table) == len(b2) and all(c.ranks == ranks for c in table)
        assert all(PRESETS[c.preset].E % ranks == 0 for c in table)
    assert select_cases("baselines_2gpu:preset=kimi-k2,tokens=2048")[0].preset == "kimi-k2"
    with pytest.raises(ValueError):
        select_cases("baselines_2gpu:nonsense=1")
    # A pipe escaped for a shell separates as one; a value no case has is an error, not a dropped case.
    escaped = select_cases("baselines_2gpu:tokens=2048\\|8192,preset=deepseek-v4-pro\\|kimi-k2,routing=balanced")
    assert {(c.preset, c.tokens_per_rank) for c in escaped} == {
        (p, t) for p in ("deepseek-v4-pro", "kimi-k2") for t in (2048, 8192)}
    with pytest.raises(ValueError, match="deepseek-v4"):
        select_cases("baselines_2gpu:preset=deepseek-v4|kimi-k2")
    for name, p in PRESETS.items():
        assert p.name == name and p.E > 0 and p.topk <= p.E


def test_fp8_tables_pair_each_shape_with_bf16_and_check_at_the_fp8_bound() -> None:
    """fp8_1gpu / fp8_2gpu: layer cases (forward and backward), each shape at fp8, fp8_dgrad and bf16,
    on presets whose hidden and intermediate sizes are whole 128-column blocks; fp8 and fp8_dgrad rows
    are checked at 0.12, bf16 rows at 0.02; a precision filter selects one; an unknown precision is
    refused."""
    sys.path.insert(0, str(REPO))
    from bench.cases import TABLES, Case, select_cases
    from bench.presets import PRESETS
    from bench.render import _routing
    from bench.run import tolerance

    for ranks in (1, 2):
        table = TABLES[f"fp8_{ranks}gpu"]
        assert table and all(c.ranks == ranks and c.passes == ("forward", "backward") and c.kind == "layer" for c in table)
        fp8 = {(c.preset, c.tokens_per_rank, c.routing) for c in table if c.precision == "fp8"}
        assert fp8 == {(c.preset, c.tokens_per_rank, c.routing) for c in table if c.precision == "bf16"}
        assert fp8 == {(c.preset, c.tokens_per_rank, c.routing) for c in table if c.precision == "fp8_dgrad"}
        for c in table:
            p = PRESETS[c.preset]
            assert p.H % 128 == 0 and p.I % 128 == 0 and p.shared_I % 128 == 0
    picked = select_cases("fp8_1gpu:precision=fp8,tokens=8192")
    assert picked and all(c.precision == "fp8" and c.tokens_per_rank == 8192 for c in picked)
    assert tolerance(picked[0]) == 0.12 and tolerance(TABLES["baselines_1gpu"][0]) == 0.02
    assert tolerance(select_cases("fp8_1gpu:precision=fp8_dgrad")[0]) == 0.12
    assert _routing({"routing": "zipf", "precision": "fp8"}) == "zipf fp8"
    assert _routing({"routing": "zipf", "precision": "bf16"}) == "zipf"
    with pytest.raises(ValueError, match="precision must be one of"):
        Case("layer", "tiny", 1, "balanced", tokens_per_rank=4, precision="fp16")


def test_profile_writes_one_kernel_table_per_timed_pass(tmp_path: Path) -> None:
    env = _env(tmp_path)
    out = tmp_path / "profiled.json"
    profile = tmp_path / "profile"
    _run([sys.executable, "-m", "bench.run", "--cases", "smoke:ranks=1,tokens=32,routing=balanced", "--smoke",
          "--impls", "torch_a2a", "--passes", "forward,backward", "--profile", str(profile), "--out", str(out)], env)
    rows = [r for r in json.loads(out.read_text())["cases"] if r["status"] == "ok"]
    tables = sorted(profile.glob("profile_*_torch_a2a_*_rank0.txt"))
    # One table per timed (case, impl, pass), each naming its pass and the operators that ran.
    assert rows and len(tables) == len(rows)
    for table in tables:
        text = table.read_text()
        pass_name = "backward" if "_backward_" in table.name else "forward"
        assert f"5 runs of the {pass_name} pass" in text
        assert "aten::" in text


def test_gemm_table_counts_each_steps_flops_and_ratio() -> None:
    from bench import gemms

    # One step's GEMMs: gate|up 2 * M * 2I * H, down 2 * M * H * I, dgrad and wgrad three of those.
    M, H, I = 48 * 512, 7168, 2048
    assert gemms.step_flops("gate_up", M, H, I) == 4.0 * M * H * I
    assert gemms.step_flops("down", M, H, I) == 2.0 * M * H * I
    assert gemms.step_flops("dgrad", M, H, I) == gemms.step_flops("wgrad", M, H, I) == 6.0 * M * H * I
    assert gemms.step_flops("dh_act", M, H, I) + gemms.step_flops("dx", M, H, I) == gemms.step_flops("dgrad", M, H, I)
    with pytest.raises(ValueError, match="multiple of 128"):
        gemms.balanced_counts(4, 100)
    assert gemms.balanced_counts(3, 256) == [256, 256, 256]
    row = gemms.Row("kimi-k2", 48, 512, "down", mok_ms=1.0, torch_ms=1.25, flops=2.0 * M * H * I, rel_error=1e-3,
                    dense_tflops=800.0)
    assert row.ratio == 1.25
    table = gemms.render([row], "# title")
    # The row's cells: both times, MoK's rate (2*M*H*I / 1 ms), the ratio, the fraction of dense.
    cells = [c.strip() for c in table.splitlines()[-1].strip("|").split("|")]
    assert cells[:5] == ["kimi-k2", "48 x 512", "down", "1.000", "1.250"]
    assert cells[5] == f"{2.0 * M * H * I / 1e-3 / 1e12:.0f}" and cells[7] == "1.25"
    assert cells[8] == f"{2.0 * M * H * I / 1e-3 / 1e12 / 800:.0%}"


def test_gemm_benchmark_says_it_needs_a_gpu(tmp_path: Path) -> None:
    env = _env(tmp_path)
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, "-m", "bench.gemms", "--out", str(tmp_path / "g.md")], env=env,
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and "needs a GPU" in proc.stderr
    # Every shape is checked before any is timed (341 once ended a run with a traceback and no table).
    proc = subprocess.run([sys.executable, "-m", "bench.gemms", "--rows", "256,341", "--out", str(tmp_path / "g.md")],
                          env=env, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and "--rows: rows per expert must be a multiple of 128" in proc.stderr
    assert "got 341" in proc.stderr


class _TorchStandIn:
    """mok._cuda_kernels' expert calls as used by bench.gemms, in plain torch on the CPU: what lets
    the benchmark's plumbing and checks run without a GPU (its MoK rows then time this, not MoK)."""

    def __init__(self, h_factor: float = 1.0) -> None:
        self.h_factor = h_factor  # != 1: a wrong SwiGLU output, which the checks must catch

    class BackwardScratch:
        def __init__(self, rows: int, intermediate: int, device: torch.device) -> None:
            self.dgu = torch.empty(rows, 2 * intermediate, dtype=torch.bfloat16, device=device)
            self.hw = torch.empty(rows, intermediate, dtype=torch.bfloat16, device=device)

    @staticmethod
    def _segments(offsets):
        o = offsets.tolist()
        return [(e, o[e], o[e + 1]) for e in range(len(o) - 1)]

    def experts_forward(self, x, offsets, w_gate, w_up, w_down, *, h, y, gu, swiglu_limit, status, which):
        from mok import testing

        I = w_gate.shape[1]
        for e, a, b in self._segments(offsets):
            if which in (0, 1):
                g, u = x[a:b].float() @ w_gate[e].float().t(), x[a:b].float() @ w_up[e].float().t()
                gu[a:b] = torch.cat([g, u], dim=1).to(gu.dtype)
                h[a:b] = (testing.swiglu(g, u, swiglu_limit) * self.h_factor).to(h.dtype)
            if which in (0, 2):
                y[a:b] = (h[a:b].float() @ w_down[e].float().t()).to(y.dtype)
        assert gu.shape[1] == 2 * I

    def experts_backward(self, x, offsets, gu, h, dy, row_weight, w_gate, w_up, w_down, *, dx, d_row_weight,
                         d_w_gate, d_w_up, d_w_down, scratch, swiglu_limit, status, which):
        from mok import testing

        I = w_gate.shape[1]
        for e, a, b in self._segments(offsets):
            w = row_weight[a:b].unsqueeze(1)
            if which in (0, 1, 3):
                dh = dy[a:b].float() @ w_down[e].float()
                dg, du = testing.swiglu_backward(gu[a:b, :I].float(), gu[a:b, I:].float(), w * dh, swiglu_limit)
                scratch.dgu[a:b] = torch.cat([dg, du], dim=1).to(scratch.dgu.dtype)
                scratch.hw[a:b] = (w * h[a:b].float()).to(scratch.hw.dtype)
                d_row_weight[a:b] = (dh * h[a:b].float()).sum(dim=1)
            if which in (0, 1, 4):
                w_gu = torch.cat([w_gate[e], w_up[e]], dim=0).float()
                dx[a:b] = (scratch.dgu[a:b].float() @ w_gu).to(dx.dtype)
            if which in (0, 2):
                d_w_gate[e] = (scratch.dgu[a:b, :I].float().t() @ x[a:b].float()).to(d_w_gate.dtype)
                d_w_up[e] = (scratch.dgu[a:b, I:].float().t() @ x[a:b].float()).to(d_w_up.dtype)
                d_w_down[e] = (dy[a:b].float().t() @ scratch.hw[a:b].float()).to(d_w_down.dtype)


class _Fp8StandIn(_TorchStandIn):
    """The fp8 calls bench.gemms makes (quantize_rows, quantize_weights, experts_forward_fp8), in plain
    torch on the CPU: power-of-two block scales, the products on the dequantized values."""

    def __init__(self, y_factor: float = 1.0) -> None:
        super().__init__()
        self.y_factor = y_factor  # != 1: a wrong fp8 output, which the check must catch

    @staticmethod
    def _scale(amax: torch.Tensor) -> torch.Tensor:
        """The smallest 2^e with amax <= 448 * 2^e (1 for an all-zero block)."""
        e = torch.ceil(torch.log2(amax.clamp_min(1e-30) / 448.0))
        return torch.where(amax > 0, torch.exp2(e), torch.ones_like(amax))

    def quantize_rows(self, x, *, k_major=True):
        rows, cols = x.shape
        blocks = x.float().reshape(rows, cols // 128, 128)
        scales = self._scale(blocks.abs().amax(dim=2))  # [rows, blocks]
        codes = (blocks / scales.unsqueeze(2)).reshape(rows, cols).to(torch.float8_e4m3fn)
        return codes, scales.t().contiguous() if k_major else scales

    def quantize_weights(self, w):
        planes, rows, cols = w.shape
        blocks = w.float().reshape(planes, rows // 128, 128, cols // 128, 128)
        scales = self._scale(blocks.abs().amax(dim=(2, 4)))  # [planes, row blocks, column blocks]
        codes = (blocks / scales[:, :, None, :, None]).reshape(planes, rows, cols).to(torch.float8_e4m3fn)
        return codes, scales

    def experts_forward_fp8(self, x, offsets, w_gate, w_up, w_down, *, h, y, h_codes, gu, swiglu_limit, status):
        from mok import testing

        xd = testing.dequantize_e4m3_rows(*x)
        wg, wu, wd = (testing.dequantize_e4m3_blocks(*q) for q in (w_gate, w_up, w_down))
        for e, a, b in self._segments(offsets):
            g, u = xd[a:b] @ wg[e].t(), xd[a:b] @ wu[e].t()
            gu[a:b] = torch.cat([g, u], dim=1).to(gu.dtype)
            h[a:b] = testing.swiglu(g, u, swiglu_limit).to(h.dtype)
        codes, scales = self.quantize_rows(h)
        h_codes[0].copy_(codes)
        h_codes[1].copy_(scales)
        hd = testing.dequantize_e4m3_rows(*h_codes)
        for e, a, b in self._segments(offsets):
            y[a:b] = (hd[a:b] @ wd[e].t() * self.y_factor).to(y.dtype)


def test_gemm_benchmark_checks_and_times_the_fp8_forward_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    """bench.gemms' fp8 steps: MoK's y is checked against torch's bf16 forward with e4m3's tolerance
    before anything is timed; where torch has no _scaled_grouped_mm (the CPU) fwd_fp8 is skipped,
    saying so; shapes without whole 128-blocks are refused by name."""
    from bench import gemms

    steps = ("fwd_fp8", "fwd_fp8_vs_bf16")
    rows = gemms.run_shape("small", 128, dense=1.0, iters=2, tolerance=0.02, kernels=_Fp8StandIn(), device="cpu",
                           steps=steps)
    assert [r.step for r in rows] == ["fwd_fp8_vs_bf16"]
    assert 1e-3 < rows[0].rel_error <= 0.08 and rows[0].mok_ms > 0 and rows[0].torch_ms > 0, rows[0]
    assert "fwd_fp8 is skipped" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="fwd_fp8_vs_bf16: MoK differs from torch"):
        gemms.run_shape("small", 128, dense=1.0, iters=2, tolerance=0.02, kernels=_Fp8StandIn(y_factor=1.2),
                        device="cpu", steps=steps)
    with pytest.raises(ValueError, match="multiples of 128"):
        gemms.run_shape("tiny", 128, dense=1.0, iters=2, tolerance=0.02, kernels=_Fp8StandIn(), device="cpu",
                        steps=steps)


def test_gemm_benchmark_checks_and_times_every_step_on_the_cpu() -> None:
    from bench import gemms

    rows = gemms.run_shape("tiny", 128, dense=1.0, iters=2, tolerance=0.02, kernels=_TorchStandIn(), device="cpu")
    assert [r.step for r in rows] == list(gemms.STEPS)
    for r in rows:
        assert r.rel_error <= 0.02 and r.mok_ms > 0 and r.torch_ms > 0, r
    # A wrong SwiGLU output is caught at its step, before anything is timed.
    with pytest.raises(RuntimeError, match="gate_up: MoK differs from torch"):
        gemms.run_shape("tiny", 128, dense=1.0, iters=2, tolerance=0.02, kernels=_TorchStandIn(h_factor=1.1),
                        device="cpu")


def test_scaling_table_compares_each_case_across_ranks(tmp_path: Path) -> None:
    """bench.scaling: per case measured at several R, the time per token of the group and the
    weak-scaling efficiency against the smallest R, rows per expert, the speedup over the baseline
    at the same R; cases seen at one R only, failed or wrong rows are left out."""
    sys.path.insert(0, str(REPO))
    from bench import scaling

    def case(ranks: int, ms: float, **extra: object) -> dict[str, object]:
        return {"kind": "layer", "preset": "kimi-k2", "tokens_per_rank": 1000, "routing": "balanced",
                "pass": "forward", "impl": "mok", "precision": "bf16", "ranks": ranks, "median_ms": ms,
                "status": "ok", "correct": True, **extra}

    files = []
    for name, cases in (("r1.json", [case(1, 2.0), case(1, 5.0, preset="mixtral-8x7b")]),
                        ("r2.json", [case(2, 2.5), case(2, 1.0, correct=False, preset="qwen3-30b-a3b"),
                                     case(2, 5.0, impl="torch_a2a"), case(1, 3.0, impl="torch_a2a")]),
                        ("r4.json", [case(4, 4.0), case(4, 9.0, status="error", preset="glm-5.2")])):
        path = tmp_path / name
        path.write_text(json.dumps({"cases": cases}))
        files.append(path)
    lines = [line for line in scaling.table(scaling.rows(files)).splitlines() if line.startswith("| kimi-k2 | 1000 |")]
    assert len(lines) == 5, lines
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines if "| mok |" in line]
    assert [c[5] for c in cells] == ["1", "2", "4"]
    assert [c[6] for c in cells] == ["21", "42", "83"]              # 1000 * R * 8 / 384, rounded
    assert [c[8] for c in cells] == ["2000.0", "1250.0", "1000.0"]  # ns per token: ms * 1e6 / (R * T)
    assert [c[9] for c in cells] == ["1.00", "0.80", "0.50"]        # smallest R's time over this R's
    assert [c[10] for c in cells] == ["1.50", "2.00", ""]           # torch_a2a's time at the same R over this one's
    assert "mixtral" not in scaling.table(scaling.rows(files))      # one R only


def test_speedup_table_divides_each_baseline_by_mok_in_the_same_case(tmp_path: Path) -> None:
    """bench.speedups: per case, the baseline's time over MoK's for baseline (a) and for the best
    correct baseline; a wrong baseline is neither shown nor best; a case MoK failed is left out."""
    sys.path.insert(0, str(REPO))
    from bench import speedups

    def case(impl: str, ms: float, preset: str = "kimi-k2", **extra: object) -> dict[str, object]:
        return {"kind": "layer", "preset": preset, "tokens_per_rank": 8192, "routing": "balanced", "ranks": 2,
                "pass": "backward", "impl": impl, "median_ms": ms, "tflops": 400.0, "status": "ok",
                "correct": True, **extra}

    path = tmp_path / "r.json"
    path.write_text(json.dumps({"cases": [
        case("torch_a2a", 50.0), case("symm_a2a", 40.0), case("mok", 20.0),
        case("mok_gemms", 10.0, baseline=False),  # MoK's own GEMMs alone: a column, never the best baseline
        case("torch_a2a", 30.0, preset="glm-5.2"), case("symm_a2a", 10.0, preset="glm-5.2", correct=False),
        case("mok", 15.0, preset="glm-5.2"),
        case("torch_a2a", 9.0, preset="mixtral-8x7b"), case("mok", 1.0, preset="mixtral-8x7b", status="error")]}))
    lines = [line for line in speedups.table([path]).splitlines() if line.startswith("| backward")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert [c[3] for c in cells] == ["kimi-k2", "glm-5.2"]  # mixtral: MoK failed
    assert cells[0][5:] == ["20.00", "400", "50.00", "40.00", "10.00", "2.50x", "2.00x"]
    assert cells[1][5:] == ["15.00", "400", "30.00", "-", "-", "2.00x", "2.00x"]


def test_targets_table_names_what_a_missed_target_would_need(tmp_path: Path) -> None:
    """bench.speedups --targets: forward wants 2.0x baseline (a) and 1.5x the best baseline; a
    miss shows the time meeting both and the share of the measured dense rate it implies."""
    sys.path.insert(0, str(REPO))
    from bench import speedups

    def case(impl: str, ms: float, pass_: str = "forward", **extra: object) -> dict[str, object]:
        return {"kind": "layer", "preset": "kimi-k2", "tokens_per_rank": 8192, "routing": "balanced", "ranks": 2,
                "pass": pass_, "impl": impl, "median_ms": ms, "tflops": 1.0, "status": "ok", "correct": True,
                "flops": 8e12, **extra}

    path = tmp_path / "r.json"
    path.write_text(json.dumps({"ceilings": {"bf16_tflops": 800.0}, "cases": [
        # forward: (a) 24 ms wants <= 12; the best baseline 20 ms wants <= 13.33: 12 ms needed
        case("torch_a2a", 24.0), case("symm_a2a", 20.0), case("mok", 13.0, floor_ms=10.0, floor_bound="compute"),
        case("mok_gemms", 10.4, baseline=False),
        # backward: 1.6x of 32 = 20, 1.3x of 26 = 20: met at 16
        case("torch_a2a", 32.0, "backward"), case("symm_a2a", 26.0, "backward"), case("mok", 16.0, "backward")]}))
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in speedups.targets([path]).splitlines()
            if line.startswith("| forward") or line.startswith("| backward")]
    forward, backward = rows
    assert forward[5:] == ["13.00", "77%", "1.85x / 2.0x", "1.54x / 1.5x", "no", "12.00", "83%", "10.00 (compute)",
                           "1.30x", "1.20x", "1.25x"]
    assert backward[9:12] == ["yes", "20.00", "50%"]
    assert backward[12:15] == ["-", "-", "-"]  # no floor given
    assert backward[15] == "-"  # no mok_gemms row for the backward
