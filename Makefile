# Two commands do all the set-up: `make run` and `make test` (each creates .venv on first use).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-all test-kernels bench bench-cluster bench-gpu bench-population bench-client-eval bench-federated-data bench-tune bench-writer bench-stages bench-compression bench-client-store bench-systems bench-personal reproduce robustness personalization compression systems async-table async-speedup drift mutants list clean

$(STAMP): pyproject.toml constraints.txt  ## every extra, at the tested versions (constraints.txt)
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[all,test,mutation]'
	touch $(STAMP)

run: $(STAMP)  ## the default benchmark: FedAvg on Synthetic(1,1), N=100, K=10, E=20, b=24
	$(BIN)/fedharness run $(ARGS)

# pytest-xdist workers for `make test` (auto: one per core); TEST_JOBS=0 runs the tests in one process
TEST_JOBS ?= auto

test: $(STAMP)  ## fast test suite on every core (slow tests too when FEDHARNESS_SLOW=1)
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

test-all: $(STAMP)
	FEDHARNESS_SLOW=1 $(MAKE) test

# OpenBLAS (numpy, scipy), MKL and ATen (torch) pick their kernels by CPU, and comparisons with independent
# computations must hold under any: ATen's plain (non-vectorized) kernels, OpenBLAS's Prescott ones and MKL's
# compatible code path run on every x86-64 machine (issue 46; MKL_CBWR is ignored where torch has no MKL)
test-kernels: $(STAMP)  ## the tests marked numeric under other kernels than this CPU's (ATen default, OpenBLAS Prescott, MKL compatible)
	ATEN_CPU_CAPABILITY=default OPENBLAS_CORETYPE=Prescott MKL_CBWR=COMPATIBLE $(MAKE) test PYTEST_ARGS="-m numeric $(PYTEST_ARGS)"

bench: $(STAMP)  ## performance workloads (about 13 minutes); figures go to docs/performance.md
	$(BIN)/python benchmarks/run.py $(ARGS)
	$(BIN)/python benchmarks/exact_sums.py
	$(BIN)/python benchmarks/bench_ray.py $(RAY_ARGS)
	$(BIN)/python benchmarks/bench_results_writer.py $(WRITER_ARGS)
	$(BIN)/python benchmarks/bench_cluster.py $(CLUSTER_ARGS)

bench-cluster: $(STAMP)  ## a round on a 5-node Ray cluster on 127.0.0.1: ResNet-18 and 2NN replies, transfer vs compute (docs/performance.md)
	$(BIN)/python benchmarks/bench_cluster.py $(CLUSTER_ARGS)

bench-stages: $(STAMP)  ## a W1 round with no update stage against another checkout (BASELINE=its python; docs/performance.md)
	$(BIN)/python benchmarks/bench_stages.py --baseline $(BASELINE) $(ARGS)

bench-compression: $(STAMP)  ## the 2NN on digits, top-k 1% with error feedback against none: ms/round and bytes_up, paired (docs/performance.md)
	$(BIN)/python benchmarks/bench_compression.py $(ARGS)

bench-client-store: $(STAMP)  ## a checkpoint of SCAFFOLD with slots for 10^4 clients: the client store (changed rows) against the code before it (b496318: every client's state in state.pt), time and bytes, paired (docs/performance.md)
	$(BIN)/python benchmarks/bench_client_store.py $(ARGS)

bench-systems: $(STAMP)  ## the systems clock: quadratic_lazy at N = 10^8 against 10^3 (set-up, peak memory, ms/round), W1 with every client on time against none, paired; the same population under FedBuff, W1 FedBuff against sync per server step (about 4 min; docs/performance.md)
	$(BIN)/python benchmarks/bench_systems.py $(ARGS)

bench-writer: $(STAMP)  ## a 20-run sweep over 2 Ray nodes: the driver as the writer vs direct writes (docs/performance.md)
	$(BIN)/python benchmarks/bench_results_writer.py $(WRITER_ARGS)

bench-tune: $(STAMP)  ## a 64-trial study sequential vs tune.batch=16 and 64, on W1 and the smoke CNN, in one process and (W1) as whole `fedharness tune` processes (docs/performance.md)
	cd benchmarks && ../$(BIN)/python bench_tune.py $(ARGS)

bench-gpu: $(STAMP)  ## nets at paper scale, kernels, GPU-sharing shards, determinism (CUDA; ARGS="--device cpu --smoke" on CPU)
	$(BIN)/python benchmarks/gpu.py $(ARGS) $(NETS_ARGS)
	$(BIN)/python benchmarks/gpu_shards.py $(ARGS) $(SHARDS_ARGS)

bench-federated-data: $(STAMP)  ## FEMNIST- and Shakespeare-shaped LEAF folders: set-up first and cached, peak memory, ms/round (docs/federated_data.md)
	cd benchmarks && ../$(BIN)/python bench_federated_data.py $(ARGS)

bench-population: $(STAMP)  ## N = 10^3, 10^6, 10^8 lazily generated clients: set-up, ms/round, memory (docs/performance.md)
	$(BIN)/python benchmarks/bench_population.py $(ARGS)

bench-client-eval: $(STAMP)  ## per-client evaluation at 3,550 clients: vectorized vs a loop over clients (docs/performance.md)
	$(BIN)/python benchmarks/bench_client_eval.py $(ARGS)

bench-personal: $(STAMP)  ## a Ditto round at K = 10 on the 2NN: batched vs client by client, the personal slots' bytes (docs/performance.md)
	$(BIN)/python benchmarks/bench_personal.py $(ARGS)

reproduce: $(STAMP)  ## every paper claim at smoke scale over 5 data draws: docs/reproductions/*.png, results.json (docs/reproductions.md)
	$(BIN)/python -m fedharness.studies.reproduce $(ARGS)

robustness: $(STAMP)  ## every aggregation rule against every attack on digits (260 runs): docs/robustness/ table and figure
	$(BIN)/fedharness sweep sweep=robustness $(ARGS)
	$(BIN)/python -m fedharness.studies.tables robustness results/sweeps/robustness --out docs/robustness

personalization: $(STAMP)  ## FedAvg + fine-tuning, Ditto, FedRep, FedBABU, APFL, pFedMe, Per-FedAvg per client on digits Dirichlet(0.1) and Synthetic(1,1), Ditto under label flipping (18 runs of 5 seeds): docs/personalization/ tables
	$(BIN)/fedharness sweep sweep=personalization $(ARGS)
	$(BIN)/python -m fedharness.studies.tables personalization results/sweeps/personalization --out docs/personalization
	$(BIN)/python -m fedharness.studies.tables personalization_label_flip results/sweeps/personalization --out docs/personalization/label_flip

compression: $(STAMP)  ## every compressor at two ratios or levels, with and without error feedback, on W1 and the 2NN on digits (30 runs of 5 seeds): docs/compression/ table and figure
	$(BIN)/fedharness sweep sweep=compression $(ARGS)
	$(BIN)/python -m fedharness.studies.tables compression results/sweeps/compression --out docs/compression

systems: $(STAMP)  ## FedAvg without and with a deadline, with over-selection, and FedNova with partial work, under lognormal and slow-tail speeds, on W1 and the 2NN on digits (16 runs of 5 seeds): docs/systems/ table and figure
	$(BIN)/fedharness sweep sweep=systems $(ARGS)
	$(BIN)/python -m fedharness.studies.tables systems results/sweeps/systems --out docs/systems

async-table: $(STAMP)  ## synchronous FedAvg (with and without a deadline), FedBuff at three (C, M) and FedAsync, under lognormal and slow-tail speeds, on W1 and the 2NN on digits (24 runs of 5 seeds): docs/async_table/ table and figure (docs/async.md)
	$(BIN)/fedharness sweep sweep=async $(ARGS)
	$(BIN)/python -m fedharness.studies.tables async results/sweeps/async --out docs/async_table

async-speedup: $(STAMP)  ## FedBuff on W1 under the slow tail, concurrency C = 4..40 with M = C/2 (4 runs of 5 seeds): speedup in simulated seconds, results/sweeps/async_speedup/report/ and docs/async_table/speedup_sim_s.png (docs/async.md)
	$(BIN)/fedharness sweep sweep=async_speedup $(ARGS)
	$(BIN)/fedharness report results/sweeps/async_speedup
	mkdir -p docs/async_table
	cp results/sweeps/async_speedup/report/figures/speedup_sim_s_test_acc_ge_0.5.png docs/async_table/speedup_sim_s.png

drift: $(STAMP)  ## FedAvg, FedProx, SCAFFOLD, FedNova, FedExP, Mime, MimeLite on quadratics and Synthetic(1,1) with exact references, E = 1, 5, 20, full and K = 5 (84 runs of 5 seeds): subopt floor and rounds to 10x above it, docs/drift/table.md (docs/algorithms.md)
	$(BIN)/fedharness sweep sweep=drift $(ARGS)
	$(BIN)/python -m fedharness.studies.drift results/sweeps/drift --out docs/drift

mutants: $(STAMP)  ## cosmic-ray over privacy, accounting, samplers, attacks, exact sums, robust rules, tuning samplers: 2-11 min a module on this shared 2-core machine, about 31 min for all seven (summed per module, load 4-9) (MODULE=privacy: one; docs/mutation.md)
	nice -n 10 $(BIN)/python mutation/mutants.py $(MODULE)

list: $(STAMP)
	$(BIN)/fedharness list

clean:
	rm -rf results outputs wandb .pytest_cache
