# pageshare: the two commands a newcomer needs.
#   make demo   installs what is needed, builds the demo golden image (cached
#               in ~/.cache/pageshare) and runs analyze-image on it
#   make test   installs what is needed and runs every test
PY := .venv/bin/python
export PAGESHARE_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/pageshare

# cargo as the tests find it (PATH, then rustup's ~/.cargo/bin), building into
# the tests' target directory, so that lint and tests share one build.
CARGO := PATH="$$PATH:$(HOME)/.cargo/bin" CARGO_TARGET_DIR="$(PAGESHARE_CACHE)/cargo-target" cargo
# The project's shell scripts (bench/e2e's run under busybox sh: POSIX).
SHELL_SCRIPTS := $(shell git ls-files '*.sh') .ci/run analyzer/pageshare-libvirt-hook \
	packaging/pageshare-host/debian/pageshare-host.postinst \
	packaging/pageshare-host/debian/pageshare-host.postrm \
	packaging/pageshare-host/grub.d/pageshare-kernel.cfg \
	packaging/pageshare-server/debian/pageshare-server.postrm

.PHONY: deps demo test lint check kernel-test packages kernel-package kernel-package-test clean

deps:
	@scripts/install-deps.sh

demo: deps
	$(PY) -m pageshare.golden --variant demo
	.venv/bin/analyze-image $$($(PY) -m pageshare.golden --variant demo)

PY_DIRS := analyzer tools tests bench kernel-syscall qemu-patches page-server packaging

# checkpatch on both series needs their sources: the kernel's and QEMU's
# (fetched and cached as the tests fetch them, which the tests need anyway).
lint: deps
	.venv/bin/ruff check $(PY_DIRS)
	.venv/bin/ruff format --check $(PY_DIRS)
	.venv/bin/mypy
	cd page-server && $(CARGO) fmt --check && $(CARGO) fmt --check --manifest-path fuzz/Cargo.toml
	cd page-server && $(CARGO) clippy --release --locked --all-targets -- -D warnings
	shellcheck $(SHELL_SCRIPTS)
	$(MAKE) -s -C crash-ext clean all
	$(PY) kernel-syscall/ktest.py check-series --no-build
	$(PY) qemu-patches/series.py checkpatch

# The inner loop: the tests that build, boot and drive nothing of the host
# (markers in pyproject.toml; about a minute warm on 2 cores).
check: deps
	$(PY) -m pytest -q -m "not vm and not build and not hostksm"

# Two workers, one lane each (tests/conftest.py says which test runs where):
# most of the time one core waits on a single-vCPU TCG guest.
test: deps lint
	$(PY) -m pytest -ra --durations=25 -n 2 --dist loadscope

# The kernel series' VM tests alone; `make test` runs them too,
# through tests/kernel/test_kernel_syscall.py.
kernel-test: deps
	kernel-syscall/run-tests.sh --config debug

# Debian packages, cached by their inputs in $(PAGESHARE_CACHE)/packages
# (packaging/debs.py prints each .deb's path).
packages: deps
	$(PY) packaging/debs.py

# The patched kernel as a Debian host kernel package (Debian's cloud-amd64
# configuration; about 40 minutes cold on 2 cores, so not part of `make test`),
# and its test: installed by apt into a clean Debian 13 root, booted, the
# series' selftest run on it.
kernel-package: deps
	$(PY) packaging/kernel_deb.py

kernel-package-test: deps
	$(PY) -m pytest -ra packaging/tests/test_kernel_package.py

clean:
	$(MAKE) -s -C crash-ext clean
	rm -rf .venv .mypy_cache .ruff_cache .pytest_cache
