"""The Triton kernels give the reference path's results bit for bit (cases: triton_cases.py here).

* On a GPU (TRITON_INTERPRET unset): the cases run here, compiled, on CUDA tensors.
* With TRITON_INTERPRET=1 in the environment: the cases run here, in Triton's interpreter.
* Otherwise (a CPU machine, the usual CI run): one test runs the cases in a child pytest with
  TRITON_INTERPRET=1. Where Triton is installed beside the venv (tools/install.sh: out of the
  way of TensorFlow, see TRITON_SITE), this whole module first reruns itself in a child process
  that sees it. Triton decides at import time whether its kernels are interpreted, and
  reads the variable again while they run, so it cannot be set for this module alone in a
  shared process without leaking into every later test; the child keeps it to itself.
* Wherever they are not interpreted: every kernel is compiled for sm_90 (H100/H200), which needs
  no GPU, so CI also checks that the compiler accepts what the interpreter ran.

Skipped only where Triton is not installed (tools/install.sh installs it, so CI runs these).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
REPO = Path(__file__).resolve().parents[3]
# tools/install.sh installs Triton outside the venv's site-packages: loaded into a process that
# already holds TensorFlow, Triton's native library crashes it (and torch imports Triton whenever
# it can find it), so only the child processes below see it.
TRITON_SITE = Path(sys.prefix) / "triton"

if importlib.util.find_spec("triton") is None:
    if not TRITON_SITE.is_dir():
        pytest.skip("Triton is not installed (tools/install.sh installs it)", allow_module_level=True)

    @pytest.mark.timeout(900)
    def test_triton_kernels_in_a_child_process():
        """This module again, in a process that sees Triton and not TensorFlow."""
        path = os.pathsep.join(p for p in (str(TRITON_SITE), os.environ.get("PYTHONPATH")) if p)
        child = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=800",
             str(Path(__file__).resolve())],
            cwd=REPO, env=dict(os.environ, PYTHONPATH=path), capture_output=True, text=True,
            timeout=880)
        report = child.stdout[-8000:] + child.stderr[-2000:]
        assert child.returncode == 0, f"the Triton kernel tests failed:\n{report}"
        assert " passed" in child.stdout and " skipped" not in child.stdout, report

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON and (INTERPRETED or torch.cuda.is_available()):
    from tests.unit.kernels.triton_cases import *  # noqa: F403  (the cases, collected here)

if HAS_TRITON and not INTERPRETED:
    TYPES = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32",
             torch.float64: "*fp64", torch.int32: "*i32", torch.int64: "*i64"}
    SMALL, LARGE = 1000, 3 * 2**30   # argument values Triton passes as i32 and as i64

    def launches(residual_dtype, input_dtype, n):
        """(module, kernel, pointer and integer arguments, constexprs) as the ops launch them."""
        from hvd_sparse.kernels.triton._common import float_bits, nan_key
        wide = torch.float64 in (residual_dtype, input_dtype) and residual_dtype != input_dtype
        r, g = nan_key(residual_dtype), nan_key(input_dtype)
        ints = dict(offset=n, numel=n, lo=n, hi=n, first_block=7, range_block=n, num_blocks=n,
                    key_min=n, p0=n, p1=n, p2=n, p3=n, sample_len=n, row_len=n, every=8, n=n,
                    high_mask=n, iterations=7, factor_bits=float_bits(0.9, residual_dtype),
                    gain_bits=float_bits(0.1, residual_dtype), c1_bits=float_bits(1.5, residual_dtype),
                    bound_bits=float_bits(3.0, residual_dtype),
                    b1_bits=float_bits(0.9, residual_dtype), g1_bits=float_bits(0.1, residual_dtype),
                    b2_bits=float_bits(0.999, residual_dtype), g2_bits=float_bits(0.001, residual_dtype),
                    c2_bits=float_bits(3.0, residual_dtype), eps_bits=float_bits(1e-8, residual_dtype))
        block = dict(BLOCK=1024)
        return [
            ("accumulate", "_nonfinite_kernel", dict(x_ptr=input_dtype, flag_ptr=torch.int64),
             dict(NAN_KEY=g, **block)),
            ("accumulate", "_accumulate_kernel",
             dict(residual_ptr=residual_dtype, input_ptr=input_dtype, skip_ptr=torch.int64,
                  counts_ptr=torch.int32, probe_ptr=torch.int64, momentum_ptr=residual_dtype,
                  second_ptr=residual_dtype),
             dict(SELECT=True, NUM_PROBES=2, GATED=True, CLEAR=True, WIDE=wide, NAN_KEY=r,
                  MOMENTUM=False, NESTEROV=False, ADAM=False, FROZEN=False, **block)),
            ("accumulate", "_accumulate_kernel",
             dict(residual_ptr=residual_dtype, input_ptr=input_dtype, skip_ptr=residual_dtype,
                  counts_ptr=residual_dtype, probe_ptr=residual_dtype, momentum_ptr=residual_dtype,
                  second_ptr=residual_dtype),
             dict(SELECT=False, NUM_PROBES=0, GATED=False, CLEAR=False, WIDE=wide, NAN_KEY=r,
                  MOMENTUM=False, NESTEROV=False, ADAM=False, FROZEN=False, **block)),
            *[("accumulate", "_accumulate_kernel",
               dict(residual_ptr=residual_dtype, input_ptr=input_dtype, skip_ptr=torch.int64,
                    counts_ptr=torch.int32, probe_ptr=torch.int64, momentum_ptr=residual_dtype,
                    second_ptr=residual_dtype),
               dict(SELECT=True, NUM_PROBES=2, GATED=True, CLEAR=True, WIDE=wide, NAN_KEY=r,
                    MOMENTUM=True, NESTEROV=nesterov, ADAM=adam, FROZEN=frozen, **block))
              for nesterov, adam, frozen in ((False, False, False), (True, False, False),
                                             (False, True, False), (False, True, True))],
            ("accumulate", "_adam_update_kernel",
             dict(average_ptr=residual_dtype, m_ptr=residual_dtype, v_ptr=residual_dtype), block),
            ("accumulate", "_count_kernel", dict(residual_ptr=residual_dtype, probe_ptr=torch.int64),
             dict(NUM_PROBES=3, NAN_KEY=r, **block)),
            ("accumulate", "_compact_kernel",
             dict(residual_ptr=residual_dtype, ends_ptr=torch.int64, index_ptr=torch.int32),
             dict(NAN_KEY=r, **block)),
            ("topk", "_histogram_kernel",
             dict(x_ptr=input_dtype, state_ptr=torch.int64, hist_ptr=torch.int64),
             dict(SHIFT=8, NAN_KEY=g, BINS=256, **block)),
            ("topk", "_choose_digit_kernel", dict(state_ptr=torch.int64, hist_ptr=torch.int64),
             dict(SHIFT=8, BINS=256)),
            ("topk", "_tie_count_kernel",
             dict(x_ptr=input_dtype, state_ptr=torch.int64, counts_ptr=torch.int32),
             dict(NAN_KEY=g, **block)),
            ("topk", "_topk_compact_kernel",
             dict(x_ptr=input_dtype, state_ptr=torch.int64, ends_ptr=torch.int64,
                  index_ptr=torch.int64),
             dict(NAN_KEY=g, **block)),
            *[("sums", "_tile_sums_kernel",
               dict(x_ptr=residual_dtype, tile_start_ptr=torch.int64, tile_end_ptr=torch.int64,
                    out_ptr=torch.float64),
               dict(MOMENTS=moments, ROWS=32, COLS=32)) for moments in (True, False)],
            ("sums", "_segment_totals_kernel",
             dict(tile_sums_ptr=torch.float64, first_tile_ptr=torch.int64, tiles_ptr=torch.int64,
                  out_ptr=torch.float64),
             dict(ROWS=32, COLS=32)),
        ], ints

    @pytest.mark.parametrize("residual_dtype, input_dtype, n", [
        (torch.float32, torch.float16, SMALL), (torch.float32, torch.float64, LARGE),
        (torch.float64, torch.bfloat16, SMALL), (torch.float64, torch.float32, LARGE)])
    def test_kernels_compile_for_hopper(residual_dtype, input_dtype, n):
        """Every kernel compiles to an sm_90 (H100/H200) binary, no GPU needed: the interpreter
        checks what the kernels compute, this checks that the compiler accepts them (its rules
        are stricter than the interpreter's). i32 and i64 integer arguments, every input dtype."""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.runtime.jit import mangle_type

        kernels, ints = launches(residual_dtype, input_dtype, n)
        for module, name, pointers, constexprs in kernels:
            kernel = getattr(importlib.import_module(f"hvd_sparse.kernels.triton.{module}"), name)
            signature = {arg: "constexpr" if arg in constexprs else
                         TYPES[pointers[arg]] if arg in pointers else mangle_type(ints[arg])
                         for arg in kernel.arg_names}
            # as the ops launch them: the accumulating kernels without FMA contraction
            options = ({"enable_fp_fusion": False} if name in ("_accumulate_kernel", "_adam_update_kernel")
                       else {})
            compiled = triton.compile(ASTSource(kernel, signature, constexprs),
                                      target=GPUTarget("cuda", 90, 32), options=options)
            assert compiled.asm["cubin"], name
            if constexprs.get("MOMENTUM") or name == "_adam_update_kernel":
                # u·m + g stays a multiply and an add, each rounded; the square root and the
                # division of the dense update are the IEEE ones
                assert "fma" not in compiled.asm["ptx"], name
            if (name == "_adam_update_kernel" or constexprs.get("ADAM")) and residual_dtype == torch.float32:
                ptx = compiled.asm["ptx"]
                assert "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx and "approx" not in ptx, name

    def test_momentum_kernel_would_contract_without_the_option():
        """The check above means something: with fusion allowed, u·m + g becomes an FMA."""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.runtime.jit import mangle_type

        kernels, ints = launches(torch.float32, torch.float32, SMALL)
        module, name, pointers, constexprs = next(k for k in kernels if k[3].get("MOMENTUM")
                                                  and not k[3]["NESTEROV"])
        kernel = getattr(importlib.import_module(f"hvd_sparse.kernels.triton.{module}"), name)
        signature = {arg: "constexpr" if arg in constexprs else
                     TYPES[pointers[arg]] if arg in pointers else mangle_type(ints[arg])
                     for arg in kernel.arg_names}
        fused = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                               options={"enable_fp_fusion": True})
        assert "fma" in fused.asm["ptx"]

if HAS_TRITON and not INTERPRETED and torch.cuda.is_available():
    def test_host_synchronizations():
        """topk_abs, accumulate and momentum_accumulate keep everything on the GPU;
        accumulate_select and momentum_accumulate_select, with or without the finite check, read
        their count, probe counts and finite flag in ONE host copy (torch's sync debug mode warns
        once per synchronizing operation)."""
        import warnings

        kt = importlib.import_module("hvd_sparse.kernels.triton")
        x = torch.randn(100_000, device="cuda")
        grads = [torch.randn(60_000, device="cuda"),
                 torch.randn(200, 200, device="cuda", dtype=torch.float16).t()]
        residual = torch.zeros(100_000, device="cuda")

        def syncs(op) -> int:
            op()   # compiles first
            torch.cuda.synchronize()
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    op()
            finally:
                torch.cuda.set_sync_debug_mode(previous)
            return sum("synchronizing" in str(w.message) for w in caught)

        select = (1000, 90_000, 1.0, [0.5, 2.0], 1, torch.int32, True)
        assert syncs(lambda: kt.topk_abs(x, 100, torch.int64)) == 0
        assert syncs(lambda: kt.accumulate(residual, grads, True)) == 0
        assert syncs(lambda: kt.accumulate_if_finite(residual, grads, True)) == 0
        assert syncs(lambda: kt.accumulate_select(residual, grads, *select)) == 1
        assert syncs(lambda: kt.accumulate_select_if_finite(residual, grads, *select)) == 1
        assert syncs(lambda: kt.all_finite(grads)) == 1
        velocity = torch.zeros(100_000, device="cuda")
        assert syncs(lambda: kt.momentum_accumulate(residual, velocity, grads, 0.9, True)) == 0
        for check in (False, True):
            assert syncs(lambda check=check: kt.momentum_accumulate_select(
                residual, velocity, grads, 0.9, False, *select, check)) == 1
        from hvd_sparse.backends.base import SecondMoment
        second = SecondMoment(torch.ones(100_000, device="cuda"), 0.999, 1.0, 1.0, 1e-8, 3.0)
        assert syncs(lambda: kt.adam_accumulate(residual, velocity, grads, 0.9, second)) == 0
        for check in (False, True):
            assert syncs(lambda check=check: kt.adam_accumulate_select(
                residual, velocity, grads, 0.9, second, *select, check)) == 1
        assert syncs(lambda: kt.adam_update(x, velocity, second.buffer, 0.9, 0.999, 1.0, 1.0, 1e-8)) == 0

if HAS_TRITON and not INTERPRETED and not torch.cuda.is_available():
    # About a minute on two free cores; the limits leave room for a machine shared with other jobs.
    @pytest.mark.timeout(600)
    def test_triton_kernels_in_the_interpreter():
        env = dict(os.environ, TRITON_INTERPRET="1")
        child = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=300",
             str(Path(__file__).resolve())],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=580)
        report = child.stdout[-8000:] + child.stderr[-2000:]
        assert child.returncode == 0, f"the Triton kernel cases failed in the interpreter:\n{report}"
        assert " passed" in child.stdout and " skipped" not in child.stdout, report
