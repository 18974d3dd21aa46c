# The project's test command is `make test` (README.md); .ci/run runs it.

.PHONY: test check citus lint cross unit isolation citus-load fuzz times times-reset bench bench-durable bench-month image

SHELL := bash
.SHELLFLAGS := -o pipefail -c

# Each test step's output is kept in TESTLOG as well; `times` prints the
# packages' times from it, slowest first.
TESTLOG := $(CURDIR)/artifacts/test.log
record = 2>&1 | { mkdir -p $(dir $(TESTLOG)) && tee -a $(TESTLOG); }

test: times-reset lint cross unit isolation citus-load fuzz times

# The edit-test loop: the tests in short mode, which skips the load tests
# (the end-to-end exports and kills, chaos, the bulk runs, the slow-client
# timeouts, the isolation run); no lint, cross builds or fuzzing (go test
# still runs its share of vet). `make test` is what CI runs.
check: times-reset
	go test -short ./... $(record)
	@$(MAKE) --no-print-directory times

# Citus built into a private PostgreSQL prefix, cached per machine, for the
# embedded Citus cluster (TALLY_EMBEDDED_WORKERS) and the tests on a
# coordinator and workers (docs/running.md). A no-op once built.
citus:
	deploy/citus/build.sh

times-reset:
	@mkdir -p $(dir $(TESTLOG)); : > $(TESTLOG)

times:
	@echo "package times, slowest first (all of the output: $(TESTLOG)):"
	@grep -E $$'^(ok|FAIL)[ \t]+[^ \t]+\t' $(TESTLOG) | sort -t$$'\t' -k3 -gr | awk -F'\t' '{sub(/ +$$/, "", $$1); printf "  %-4s %9s  %s\n", $$1, $$3, $$2}'

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	go vet ./...
	go run honnef.co/go/tools/cmd/staticcheck@v0.8.2 ./...
	cd deploy/helm && go vet ./... && go run honnef.co/go/tools/cmd/staticcheck@v0.8.2 ./...

# Tally builds and vets (test files included) on every platform Go
# developers work on, not only on the Linux that CI runs: the embedded
# cluster runs on Linux and macOS, and on Windows Start says to set
# TALLY_DATABASE_URL. Without cgo, as a cross build is.
CROSS_PLATFORMS := linux/amd64 linux/arm64 darwin/arm64 darwin/amd64 windows/amd64

cross:
	@set -e; for p in $(CROSS_PLATFORMS); do \
		echo "cross: $$p"; \
		CGO_ENABLED=0 GOOS=$${p%/*} GOARCH=$${p#*/} go build ./...; \
		CGO_ENABLED=0 GOOS=$${p%/*} GOARCH=$${p#*/} go vet ./...; \
	done

# The Helm chart's test is a module of its own (deploy/helm/go.mod): Helm's
# and Kubernetes' packages stay out of Tally's. cmd/tally's load tests take
# most of go test's default 10 minutes per package on two cores: the
# timeout is raised so that a slow machine fails on a test, not the clock.
unit:
	go test -timeout 25m ./... $(record)
	cd deploy/helm && go test ./... $(record)

# The isolation test (1M ledger rows, 40 concurrent reports while usage is
# posted) on its own, after the other tests: it loads both cores.
isolation:
	TALLY_ISOLATION_TEST=1 go test ./cmd/tally/app -run '^TestReportsOfReadOnlyTokensDoNotStopIngestOrRiver$$' -count=1 -v $(record)

# The load tests on a Citus coordinator and two workers, each on its own
# after the other tests (three servers and the nodes load both cores): the
# chaos run (a worker restarted, a shard group moved under load), then the
# v1 export end to end with SIGKILLs on a distributed database. It needs
# make citus. The stream's export and the cancellations under kills on
# Citus are not in it (docs/development.md).
citus-load:
	TALLY_CITUS_CHAOS_TEST=1 go test ./cmd/tally -run '^TestChaosOnCitus$$' -count=1 -v -timeout 20m $(record)
	TALLY_TEST_ENGINE=citus go test ./cmd/tally -run '^TestExportEndToEnd$$/^stripe_meter_events/kills=6$$' -count=1 -v -timeout 20m $(record)

# A brief run of every fuzz target. The budget is a count of executions,
# not a duration: Go 1.26's coordinator can report a spurious "context
# deadline exceeded" when a -fuzztime duration ends mid-execution
# (go.dev/issue/75804, fixed in Go 1.27); a count has no deadline to race.
# Minimising new inputs is off: it can stall on one large input; a failure
# is still reported, with its input, unminimised.
fuzz:
	go test ./meter -run '^$$' -fuzz '^FuzzDecode$$' -fuzztime 30000x -fuzzminimizetime 0 $(record)
	go test ./mappings -run '^$$' -fuzz '^FuzzFeatureInput$$' -fuzztime 20000x -fuzzminimizetime 0 $(record)
	go test ./exporter -run '^$$' -fuzz '^FuzzClassify$$' -fuzztime 20000x -fuzzminimizetime 0 $(record)
	go test ./exporter -run '^$$' -fuzz '^FuzzClassifyReport$$' -fuzztime 20000x -fuzzminimizetime 0 $(record)
	go test ./api/webhookfuzz -run '^$$' -fuzz '^FuzzStripeEvent$$' -fuzztime 20000x -fuzzminimizetime 0 $(record)

# The benchmarks behind docs/performance.md, on the tests' throwaway cluster
# (tmpfs, fsync off: CPU and protocol costs). The ingest benchmarks start a
# durable cluster of their own either way.
bench:
	go test ./outbox -run '^$$' -bench ClaimAcceptVsRiver -benchtime 1x
	go test ./api -run '^$$' -bench IngestVsCopyFrom -benchtime 1x
	go test ./api -run '^$$' -bench SingleEventIngestVsInsert -benchtime 1x
	go test ./exporter -run '^$$' -bench DeliverUnlimited -benchtime 1x
	go test ./exporter -run '^$$' -bench DeliverAtStripeLimit -benchtime 1x
	go test ./exporter -run '^$$' -bench DeliverStreamVsV1 -benchtime 1x
	go test ./reconcile -run '^$$' -bench Reconcile100k -benchtime 1x
	go test ./meter -run '^$$' -bench 'BenchmarkStage$$' -benchtime 1x -timeout 30m
	go test ./cmd/tally -run '^$$' -bench NodeMemory -benchtime 1x
	go test ./cmd/tally -run '^$$' -bench 'BenchmarkImport$$' -benchtime 1x
	go test ./internal/testkit/history -run '^$$' -bench History -benchtime 1x -timeout 0
	go test ./archive -run '^$$' -bench BenchmarkArchive -benchtime 1x -timeout 0

# The database-bound benchmarks again on a durable cluster (fsync and
# synchronous_commit on, on disk: the embedded default's settings).
bench-durable:
	TALLY_TEST_DURABLE=1 go test ./outbox -run '^$$' -bench ClaimAcceptVsRiver -benchtime 1x
	TALLY_TEST_DURABLE=1 go test ./exporter -run '^$$' -bench DeliverStreamVsV1 -benchtime 1x
	TALLY_TEST_DURABLE=1 go test ./exporter -run '^$$' -bench DeliverUnlimited -benchtime 1x
	TALLY_TEST_DURABLE=1 go test ./reconcile -run '^$$' -bench Reconcile100k -benchtime 1x
	TALLY_TEST_DURABLE=1 go test ./meter -run '^$$' -bench 'BenchmarkStage$$' -benchtime 1x -timeout 30m
	TALLY_TEST_DURABLE=1 go test ./cmd/tally -run '^$$' -bench 'BenchmarkImport$$' -benchtime 1x
	TALLY_TEST_DURABLE=1 go test ./internal/testkit/history -run '^$$' -bench History -benchtime 1x -timeout 0

# BenchmarkMonth: a month of TALLY_MONTH_EVENTS events (100 million by
# default) beside one of a million, on a durable cluster on the disk of
# TMPDIR; refuses to start without the room (about 50 GB). About an hour.
bench-month:
	TALLY_TEST_DURABLE=1 go test ./internal/testkit/history -run '^$$' -bench '^BenchmarkMonth$$' -benchtime 1x -timeout 0

# The container image (deploy/container/Containerfile, docs/operations.md):
# the binary is built here, static, and copied in with this machine's CA
# certificates, since no Go builder image can be pulled offline. The
# format is Docker's, which keeps the HEALTHCHECK (OCI's has none); no
# step is worth caching, so no intermediate image is kept. With buildah:
# make image CONTAINER_BUILD="buildah build".
# The version and revision come from git alone (a VERSION in the
# environment does not count; make image VERSION=… does).
VERSION = $(shell git describe --always --dirty)
REVISION = $(shell git rev-parse HEAD)
IMAGE ?= localhost/tally:$(VERSION)
CONTAINER_BUILD ?= podman build
CA_CERTIFICATES ?= /etc/ssl/certs/ca-certificates.crt

image:
	@set -e; ctx=$$(mktemp -d); trap 'rm -rf "$$ctx"' EXIT; \
	CGO_ENABLED=0 go build -trimpath -tags timetzdata \
		-ldflags "-s -w -X main.version=$(VERSION) -X main.image=true" -o "$$ctx/tally" ./cmd/tally; \
	cp $(CA_CERTIFICATES) "$$ctx/ca-certificates.crt"; \
	$(CONTAINER_BUILD) --format docker --layers=false --file deploy/container/Containerfile \
		--build-arg VERSION=$(VERSION) --build-arg REVISION=$(REVISION) --tag $(IMAGE) "$$ctx"; \
	echo "image: $(IMAGE)"
