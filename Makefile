# torchloopd build.  `make run` and `make test` are the two commands a new
# user needs; both run the idempotent set-up first.  See README.md.

BUILD     ?= build
PY        := $(CURDIR)/.venv/bin/python
TORCH_LIB := $(firstword $(wildcard $(CURDIR)/.venv/lib/python3*/site-packages/torch/lib))
TORCH_INC := $(patsubst %/lib,%/include,$(TORCH_LIB))
MSGPACK_PC := $(shell pkg-config --exists msgpack-c 2>/dev/null && echo msgpack-c || echo msgpack)
PKGS      := libuv libsystemd jansson $(MSGPACK_PC)

CC        ?= cc
WARN      := -std=c11 -Wall -Wextra -Werror -Wshadow -Wstrict-prototypes -Wno-missing-field-initializers
# the daemon's layers are its folders (docs/architecture.md): ops, server, graph, base
DAEMON_DIRS := daemon/ops daemon/server daemon/graph daemon/base
CPPFLAGS  += -D_GNU_SOURCE -Iproto $(DAEMON_DIRS:%=-I%) -Iclient -DTORCHLOOPD_PREFIX=\"$(CURDIR)\"
CFLAGS    ?= -O2 -g
CFLAGS    += $(WARN) -fPIC $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
ifeq ($(SAN),1)
CFLAGS    += -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
LDFLAGS   += -fsanitize=address,undefined
endif
MSGPACK_LIBS := $(shell pkg-config --libs $(MSGPACK_PC) 2>/dev/null)
UV_LIBS      := $(shell pkg-config --libs libuv 2>/dev/null)
SD_LIBS      := $(shell pkg-config --libs libsystemd 2>/dev/null)
# the remote cache tier (daemon/base/remote*.c): Redis, HMAC
REMOTE_LIBS  := $(shell pkg-config --libs hiredis libcrypto 2>/dev/null)
# DT_RPATH (not RUNPATH): it also serves the artifacts the daemon dlopens,
# which NEED libtorch.so; linking libtorch keeps that SONAME loaded anyway.
TORCH_LIBS   := -L$(TORCH_LIB) -Wl,--disable-new-dtags -Wl,-rpath,$(TORCH_LIB) -Wl,--no-as-needed -ltorch -ltorch_cpu -lc10 -Wl,--as-needed
CRIT_LIBS    := $(shell pkg-config --libs criterion 2>/dev/null)

PROTO_SRC  := $(wildcard proto/*.c)
PROTO_OBJ  := $(PROTO_SRC:%.c=$(BUILD)/%.o)
DAEMON_SRC := $(filter-out daemon/server/main.c daemon/base/sandbox_main.c,$(wildcard $(DAEMON_DIRS:%=%/*.c)))
DAEMON_OBJ := $(DAEMON_SRC:%.c=$(BUILD)/%.o)
CLIENT_SRC := $(filter-out client/cli.c client/cli_stats.c client/treejson.c,$(wildcard client/*.c))
CLIENT_OBJ := $(CLIENT_SRC:%.c=$(BUILD)/%.o)
DAEMON_LIB := $(if $(DAEMON_SRC),$(BUILD)/libdaemon.a)
UNIT_SRC   := $(wildcard tests/unit/test_*.c)
UNIT_BIN   := $(UNIT_SRC:tests/unit/%.c=$(BUILD)/tests/%)
E2E_SRC    := $(wildcard tests/e2e/test_*.c)
E2E_BIN    := $(E2E_SRC:tests/e2e/test_%.c=$(BUILD)/tests/e2e_%)
FUZZ_SECONDS ?= 60

.PHONY: all setup build run test test-unit test-e2e sanitize fuzz bench clean format install uninstall

all: build

setup:
	@bash scripts/setup.sh

# `build` re-reads the Makefile after set-up so the venv's torch path is known.
# The C sources compile JOBS at a time (default: one per CPU; `make JOBS=1 ...`).
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
build: setup
	@$(MAKE) -j$(JOBS) --no-print-directory binaries

BINARIES := $(BUILD)/libproto.a
ifneq ($(wildcard daemon/server/main.c),)
BINARIES += $(BUILD)/torchloopd $(BUILD)/torchloopd-sandbox
endif
ifneq ($(wildcard client/cli.c),)
BINARIES += $(BUILD)/torchloop $(BUILD)/libtorchloop.so $(BUILD)/libtorchloop.a $(BUILD)/torchloop.pc
endif

.PHONY: binaries tests
binaries: $(BINARIES)
tests: $(UNIT_BIN) $(E2E_BIN) $(BUILD)/torchloopd-testhooks $(BUILD)/torchloopd-sandbox

HEADERS := $(wildcard proto/*.h $(DAEMON_DIRS:%=%/*.h) client/*.h)
$(BUILD)/%.o: %.c $(HEADERS)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -c $< -o $@

$(BUILD)/libproto.a: $(PROTO_OBJ)
	ar rcs $@ $^

$(BUILD)/libdaemon.a: $(DAEMON_OBJ)
	ar rcs $@ $^

$(BUILD)/torchloopd: $(BUILD)/daemon/server/main.o $(BUILD)/libdaemon.a $(BUILD)/libproto.a
	$(CC) $(LDFLAGS) -o $@ $^ $(UV_LIBS) $(SD_LIBS) $(REMOTE_LIBS) $(MSGPACK_LIBS) $(TORCH_LIBS) -ldl -lpthread -lm

# The compile worker's launcher (daemon/base/sandbox.h): libc only, so
# nothing but libc runs before the sandbox is on.
$(BUILD)/torchloopd-sandbox: $(BUILD)/daemon/base/sandbox_main.o $(BUILD)/daemon/base/sandbox.o
	$(CC) $(LDFLAGS) -o $@ $^

# The same daemon with test-only hooks (SIGUSR2 stalls the loop, for the
# watchdog test; SIGUSR1 the graph runner and a pool thread, for health's
# pool test); the installed torchloopd never has them.
$(BUILD)/daemon/server/daemon-testhooks.o: daemon/server/daemon.c $(HEADERS)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) -DTORCHLOOPD_TEST_HOOKS $(CFLAGS) -c $< -o $@

$(BUILD)/torchloopd-testhooks: $(BUILD)/daemon/server/main.o $(BUILD)/daemon/server/daemon-testhooks.o $(BUILD)/libdaemon.a $(BUILD)/libproto.a
	$(CC) $(LDFLAGS) -o $@ $^ $(UV_LIBS) $(SD_LIBS) $(REMOTE_LIBS) $(MSGPACK_LIBS) $(TORCH_LIBS) -ldl -lpthread -lm

$(BUILD)/libtorchloop.a: $(CLIENT_OBJ) $(PROTO_OBJ)
	ar rcs $@ $^

$(BUILD)/libtorchloop.so: $(CLIENT_OBJ) $(PROTO_OBJ)
	$(CC) -shared $(LDFLAGS) -o $@ $^ $(MSGPACK_LIBS)

$(BUILD)/torchloop: $(BUILD)/client/cli.o $(BUILD)/client/cli_stats.o $(BUILD)/client/treejson.o $(BUILD)/libtorchloop.a
	$(CC) $(LDFLAGS) -o $@ $^ $(shell pkg-config --libs jansson 2>/dev/null) $(MSGPACK_LIBS) -lm

TEST_DEPS := $(BUILD)/libproto.a $(DAEMON_LIB) $(wildcard tests/unit/*.h tests/unit/helpers.c)
$(BUILD)/tests/test_%: tests/unit/test_%.c $(TEST_DEPS)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) -Itests/unit $(CFLAGS) $(TEST_LDFLAGS) -o $@ $< $(wildcard tests/unit/helpers.c) $(DAEMON_LIB) $(BUILD)/libproto.a \
		$(CRIT_LIBS) $(UV_LIBS) $(SD_LIBS) $(REMOTE_LIBS) $(MSGPACK_LIBS) $(TORCH_LIBS) -ldl -lpthread -lm
# test_oom fails our own allocations in turn (malloc fault injection)
$(BUILD)/tests/test_oom: TEST_LDFLAGS = -Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc,--wrap=aligned_alloc

E2E_DEPS := tests/e2e/harness.c tests/e2e/harness.h tests/e2e/fixture.h tests/unit/params.h tests/unit/helpers.c tests/unit/helpers.h client/treejson.c $(BUILD)/libtorchloop.a
$(BUILD)/tests/e2e_%: tests/e2e/test_%.c $(E2E_DEPS) $(BUILD)/libproto.a $(DAEMON_LIB)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) -Itests/e2e -Itests/unit $(CFLAGS) -Wno-format-truncation -o $@ $< tests/e2e/harness.c tests/unit/helpers.c client/treejson.c \
		$(DAEMON_LIB) $(BUILD)/libtorchloop.a $(CRIT_LIBS) $(shell pkg-config --libs jansson) \
		$(UV_LIBS) $(SD_LIBS) $(REMOTE_LIBS) $(MSGPACK_LIBS) $(TORCH_LIBS) -ldl -lpthread -lm

test: build
	@$(MAKE) -j$(JOBS) --no-print-directory tests
	@$(MAKE) --no-print-directory run-tests
	@# the daemon under valgrind and the fuzzer, side by side (one core each);
	@# each one's output printed whole when it ends
	@$(MAKE) -j2 --output-sync=target --no-print-directory valgrind fuzz

# The daemon's memory check under valgrind (scripts/valgrind-daemon.sh).
.PHONY: valgrind
valgrind:
	@bash scripts/valgrind-daemon.sh $(BUILD)

.PHONY: run-tests
run-tests: tests binaries
	@bash scripts/run-tests.sh $(BUILD) $(UNIT_BIN) $(E2E_BIN)

sanitize: setup
	@$(MAKE) -j$(JOBS) --no-print-directory BUILD=build-san SAN=1 binaries
	@$(MAKE) -j$(JOBS) --no-print-directory BUILD=build-san SAN=1 tests
	@TORCHLOOP_TEST_SAN=1 $(MAKE) --no-print-directory BUILD=build-san SAN=1 run-tests
	@$(MAKE) --no-print-directory fuzz-graph

# libFuzzer over frame + envelope + tree decoding, under ASan+UBSan.
FUZZ_BIN := $(BUILD)/fuzz/fuzz_proto
$(FUZZ_BIN): tests/fuzz/fuzz_proto.c $(PROTO_SRC) $(wildcard proto/*.h)
	@mkdir -p $(dir $@)
	clang -g -O1 -std=c11 -D_GNU_SOURCE -Iproto $(shell pkg-config --cflags $(MSGPACK_PC)) \
		-fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
		-o $@ tests/fuzz/fuzz_proto.c $(PROTO_SRC) $(MSGPACK_LIBS)

# Then the graph-format fuzzer (mutated captured graphs through the worker's
# loader, tests/fuzz/fuzz_graph.py), after the proto fuzzer on the same core:
# `make test` runs this target beside valgrind's, which takes longer than both.
fuzz: setup
	@$(MAKE) --no-print-directory $(FUZZ_BIN)
	@bash scripts/fuzz.sh $(FUZZ_BIN) $(FUZZ_SECONDS)
	@$(MAKE) --no-print-directory fuzz-graph

.PHONY: fuzz-graph
fuzz-graph: setup
	@FUZZ_SECONDS=$(FUZZ_SECONDS) $(PY) tests/fuzz/fuzz_graph.py

run: build
	exec $(BUILD)/torchloopd --adapters examples/adapters --state-dir $(BUILD)/state $(RUN_ARGS)

# Benchmarks: never part of `make test`; numbers go to docs/performance.md.
$(BUILD)/bench_c: tests/bench/bench_c.c $(BUILD)/libdaemon.a $(BUILD)/libtorchloop.a
	$(CC) $(CPPFLAGS) $(CFLAGS) -o $@ $< $(BUILD)/libdaemon.a $(BUILD)/libtorchloop.a \
		$(UV_LIBS) $(SD_LIBS) $(REMOTE_LIBS) $(MSGPACK_LIBS) $(TORCH_LIBS) -ldl -lpthread -lm

bench: build
	@mkdir -p $(BUILD)/bench
	@c=$$(git rev-parse --short HEAD 2>/dev/null || echo '?'); \
	 git status --porcelain -- . ':!docs' 2>/dev/null | grep -q . && c="$$c with uncommitted changes"; \
	 echo "$$c" > $(BUILD)/bench/commit
	@$(MAKE) --no-print-directory $(BUILD)/bench_c
	@$(PY) -c 'import matplotlib' 2>/dev/null || .venv/bin/pip install -q -r requirements-bench.txt
	$(PY) tests/bench/strategy.py $(BUILD) $(BUILD)/bench/strategy.json
	$(PY) tests/bench/tier.py $(BUILD) $(BUILD)/bench/tier.json
	$(PY) tests/bench/batch.py $(BUILD) $(BUILD)/bench/batch.json
	$(PY) tests/bench/outvariant.py $(BUILD)/bench/outvariant.json
	$(PY) tests/bench/bigruns.py $(BUILD) $(BUILD)/bench/bigruns.json
	$(PY) tests/bench/capture.py $(BUILD) $(BUILD)/bench/capture.json
	$(PY) tests/bench/eagerfirst.py $(BUILD) $(BUILD)/bench/eagerfirst.json
	$(PY) tests/bench/pypath.py $(BUILD) $(BUILD)/bench/pypath.json
	$(PY) tests/bench/loaded.py $(BUILD) $(BUILD)/bench/loaded.json
	$(PY) tests/bench/checkpoint.py $(BUILD) $(BUILD)/bench/checkpoint.json
	$(PY) tests/bench/stiff.py $(BUILD) $(BUILD)/bench/stiff.json
	$(PY) tests/bench/remote.py $(BUILD) $(BUILD)/bench/remote.json
	$(PY) tests/bench/bench.py $(BUILD) $(BUILD)/bench $(BENCH_ARGS)
	$(PY) tests/bench/report.py $(BUILD)/bench docs/performance.md
	cp $(BUILD)/bench/*.png docs/

# pkg-config file for the build tree (tests) and for an install; the version
# is proto/protocol.h's TORCHLOOP_VERSION.
VERSION := $(shell sed -n 's/^\#define TORCHLOOP_VERSION "\(.*\)"/\1/p' proto/protocol.h)
$(BUILD)/torchloop.pc: client/torchloop.pc.in proto/protocol.h
	sed -e 's|@PREFIX@|$(CURDIR)|' -e 's|@LIBDIR@|$(CURDIR)/$(BUILD)|' -e 's|@VERSION@|$(VERSION)|' \
	    -e 's|@INCLUDEDIR@|$(CURDIR)/client|' -e 's|@MSGPACK_LIBS@|$(MSGPACK_LIBS)|' $< > $@

PREFIX      ?= /usr/local
SYSTEMD_DIR ?= /etc/systemd/system
# the compile worker's script and its package (daemon/server/worker_target.c digests the
# package's every module)
WORKER_PKG := $(wildcard daemon/worker/torchloop_worker/*.py)
INSTALL_FILES = $(DESTDIR)$(PREFIX)/bin/torchloopd $(DESTDIR)$(PREFIX)/bin/torchloop \
	$(DESTDIR)$(PREFIX)/lib/libtorchloop.so $(DESTDIR)$(PREFIX)/lib/libtorchloop.a \
	$(DESTDIR)$(PREFIX)/include/torchloop.h $(DESTDIR)$(PREFIX)/lib/pkgconfig/torchloop.pc \
	$(DESTDIR)$(PREFIX)/lib/torchloopd/compile_worker.py $(DESTDIR)$(PREFIX)/lib/torchloopd/torchloopd-sandbox \
	$(patsubst daemon/worker/%,$(DESTDIR)$(PREFIX)/lib/torchloopd/%,$(WORKER_PKG)) \
	$(DESTDIR)$(SYSTEMD_DIR)/torchloopd.service $(DESTDIR)$(SYSTEMD_DIR)/torchloopd.socket \
	$(DESTDIR)/usr/lib/sysusers.d/torchloopd.conf $(DESTDIR)/usr/lib/tmpfiles.d/torchloopd.conf

install: build $(BUILD)/torchloop.pc
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/include \
		$(DESTDIR)$(PREFIX)/lib/torchloopd/torchloop_worker $(DESTDIR)$(SYSTEMD_DIR) $(DESTDIR)/usr/lib/sysusers.d \
		$(DESTDIR)/usr/lib/tmpfiles.d $(DESTDIR)$(PREFIX)/share/torchloopd/examples
	install -m 0755 $(BUILD)/torchloopd $(BUILD)/torchloop $(DESTDIR)$(PREFIX)/bin/
	install -m 0644 $(BUILD)/libtorchloop.so $(BUILD)/libtorchloop.a $(DESTDIR)$(PREFIX)/lib/
	install -m 0644 client/torchloop.h $(DESTDIR)$(PREFIX)/include/
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@LIBDIR@|$(PREFIX)/lib|' -e 's|@INCLUDEDIR@|$(PREFIX)/include|' \
	    -e 's|@VERSION@|$(VERSION)|' -e 's|@MSGPACK_LIBS@|$(MSGPACK_LIBS)|' client/torchloop.pc.in > $(DESTDIR)$(PREFIX)/lib/pkgconfig/torchloop.pc
	install -m 0644 daemon/worker/compile_worker.py $(DESTDIR)$(PREFIX)/lib/torchloopd/
	install -m 0755 $(BUILD)/torchloopd-sandbox $(DESTDIR)$(PREFIX)/lib/torchloopd/
	install -m 0644 $(WORKER_PKG) $(DESTDIR)$(PREFIX)/lib/torchloopd/torchloop_worker/
	sed -e 's|/usr/local/bin/torchloopd|$(PREFIX)/bin/torchloopd --worker $(PREFIX)/lib/torchloopd/compile_worker.py --python $(PY)|' \
	    systemd/torchloopd.service > $(DESTDIR)$(SYSTEMD_DIR)/torchloopd.service
	install -m 0644 systemd/torchloopd.socket $(DESTDIR)$(SYSTEMD_DIR)/
	install -m 0644 systemd/torchloopd.sysusers $(DESTDIR)/usr/lib/sysusers.d/torchloopd.conf
	install -m 0644 systemd/torchloopd.tmpfiles $(DESTDIR)/usr/lib/tmpfiles.d/torchloopd.conf
	cp -r examples/. $(DESTDIR)$(PREFIX)/share/torchloopd/examples/

uninstall:
	rm -f $(INSTALL_FILES)
	rm -rf $(DESTDIR)$(PREFIX)/share/torchloopd $(DESTDIR)$(PREFIX)/lib/torchloopd

format:
	clang-format -i proto/*.[ch] $(wildcard daemon/*/*.[ch] client/*.[ch] client/python/torchloop/*.c tests/*/*.[ch])

clean:
	rm -rf build build-san
