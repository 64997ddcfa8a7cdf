# Every target installs what it needs first (tools/install.sh is idempotent: seconds when done).
VENV   := .venv
PYTHON := $(VENV)/bin/python
RUN    := OMP_NUM_THREADS=1 TF_CPP_MIN_LOG_LEVEL=3 TF_USE_LEGACY_KERAS=1
NP     ?= 2
PYTEST_ARGS ?=

.PHONY: install demo test unit unit-reference unit-baseline lint bench report clean

install:
	@bash tools/install.sh

demo: install
	$(RUN) $(VENV)/bin/horovodrun --gloo -np $(NP) -H localhost:$(NP) $(PYTHON) examples/digits_torch.py \
		--method exdyna --option threshold_scaling=tracking --compare-dense

lint: install
	$(VENV)/bin/ruff check hvd_sparse tests examples tools scripts
	$(VENV)/bin/mypy

# pytest exits 5 when a selection (PYTEST_ARGS="-k ...") matches no test: report it, do not fail.
NO_MATCH = if [ $$rc -eq 5 ]; then echo "pytest: no tests matched '$(PYTEST_ARGS)'"; rc=0; fi

# Every test with the kernels (the default), then the unit suite again on the reference path, and
# the kernel tests on the native library's baseline build.
test: install lint
	@$(RUN) $(PYTHON) -m pytest -ra $(PYTEST_ARGS); rc=$$?; $(NO_MATCH); exit $$rc
	@$(MAKE) --no-print-directory unit-reference
	@$(MAKE) --no-print-directory unit-baseline

# The unit suite with HVD_SPARSE_KERNELS=off: the reference path must pass on its own.
unit-reference: install
	@echo "unit tests again with HVD_SPARSE_KERNELS=off (the reference path)"
	@HVD_SPARSE_KERNELS=off $(RUN) $(PYTHON) -m pytest -ra -q -m "not multiproc" \
		--ignore=tests/unit/kernels/test_triton.py $(PYTEST_ARGS); rc=$$?; \
	$(NO_MATCH); exit $$rc

# The CPU kernel tests again on the library's baseline build: an x86-64-v3 (AVX2) CPU loads the
# v3 build by default, and both must give the reference path's results.
unit-baseline: install
	@echo "kernel tests again with HVD_SPARSE_CPU_LEVEL=baseline (the native library without AVX2)"
	@HVD_SPARSE_CPU_LEVEL=baseline $(RUN) $(PYTHON) -m pytest -ra -q tests/unit/kernels \
		--ignore=tests/unit/kernels/test_triton.py $(PYTEST_ARGS); rc=$$?; \
	$(NO_MATCH); exit $$rc

unit: install
	$(RUN) $(PYTHON) -m pytest -ra -m "not multiproc" $(PYTEST_ARGS)

# The quick version of every measurement (about 20 minutes on 2 cores), into bench/quick/ with its
# own BENCHMARKS.md; the emulated-network part of the end-to-end benchmark needs root.
QUICK := bench/quick
bench: install
	$(RUN) $(PYTHON) scripts/bench_select.py --quick --out-dir $(QUICK)
	$(RUN) $(PYTHON) scripts/fidelity.py --quick --out-dir $(QUICK)
	$(RUN) $(PYTHON) scripts/convergence.py --quick --out-dir $(QUICK)
	$(RUN) $(PYTHON) scripts/sim_scale.py --quick --out-dir $(QUICK)
	$(RUN) $(PYTHON) scripts/bench_e2e.py --quick --out $(QUICK)/e2e \
		$$([ "$$(id -u)" -eq 0 ] || echo "--nets loopback")
	$(PYTHON) scripts/report.py --bench-dir $(QUICK) --out $(QUICK)/BENCHMARKS.md

# BENCHMARKS.md from the full runs' results in bench/ (their commands are in BENCHMARKS.md).
report: install
	$(PYTHON) scripts/report.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
